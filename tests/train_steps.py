"""A ``Model.train`` callback for tests: every step's loss and first input column, and a simulated kill."""

from __future__ import annotations

from mindspore.train import Callback

__all__ = ["StepLog"]


class StepLog(Callback):
    """Records each step's loss and the first input column of its batch; raises at the end of ``crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}
        self.inputs: dict[int, list[float]] = {}
        self.crash_at = crash_at

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        step = int(params.cur_step_num)
        self.losses[step] = float(params.net_outputs.asnumpy())
        self.inputs[step] = params.train_dataset_element[0].asnumpy()[:, 0].tolist()
        if step == self.crash_at:
            raise RuntimeError(f"killed after step {step}")
