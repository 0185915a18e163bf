"""The on-disk format, all in one place; its specification is docs/format.md.

- :mod:`.safetensors_file`: the data files (safetensors headers, dtype names);
- :mod:`.metadata_json`: the committed metadata as JSON (decoded as a stream by :mod:`.json_stream`,
  its usual entries by runs by :mod:`.regular_runs`, their records made on first access by
  :mod:`.deferred_storage`);
- :mod:`.storage_entry`: one ``storage_data`` entry as JSON (the decoder of both metadata forms);
- :mod:`.consistency`: the checks that a metadata's items and storage entries match (single entries and byte
  ranges: :mod:`.entry_checks`);
- the indexed form (format 2.1): :mod:`.grid_holders` (which rank holds a grid chunk), :mod:`.rank_index`
  (a rank's index file), :mod:`.indexed_json` (its members of ``metadata.json``), :mod:`.indexed_storage`
  (the lazy ``storage_data``);
- :mod:`.checksum`: xxh3 digests of blocks and tiles;
- :mod:`.byte_ranges`: which byte runs of a stored chunk hold a region;
- :mod:`.cover`: the rule that a tensor's chunks tile it exactly.

Nothing here does I/O beyond reading or writing one given file, and nothing
imports the planner, storage or API layers above it. Change the code and
docs/format.md together (and the format version, by the rule written there).
"""

__all__: list[str] = []
