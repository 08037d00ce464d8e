"""Users' own datasets as the prompt source: reading files (``files.py``), checking them before
a run (``check.py``), rendering prompts with chat templates (``render.py``), the
:class:`DatasetTask` over them (``source.py``) and the steps that cover ``data.epochs``
(``epochs.py``). ``models/loading.make_task`` builds a DatasetTask when ``data.train_files`` is
set."""

from hybridrl.data.check import check_columns, check_data
from hybridrl.data.epochs import steps_for_epochs
from hybridrl.data.files import DataError, as_paths, first_row, read_files
from hybridrl.data.render import dig, encode, is_chat, render_prompt, render_text
from hybridrl.data.source import DatasetTask

__all__ = [
    "DataError",
    "DatasetTask",
    "as_paths",
    "check_columns",
    "check_data",
    "dig",
    "encode",
    "first_row",
    "is_chat",
    "read_files",
    "render_prompt",
    "render_text",
    "steps_for_epochs",
]
