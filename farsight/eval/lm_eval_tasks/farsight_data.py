"""Loads the items of farsight's exported lm-eval tasks from the folder this file is in.

`farsight eval passkey --export-choice DIR` and `farsight eval ruler --export DIR` copy this file
into DIR, and each task YAML names it as `custom_dataset: !function farsight_data.load` with
`data_files` relative to DIR, so the folder runs wherever it is moved to. Self-contained (no
farsight import): the folder runs wherever lm-eval does.
"""

import os


def load(data_files=None, **_):
    """The task's JSONL files as a datasets.DatasetDict, relative paths read from this folder."""
    import datasets

    here = os.path.dirname(os.path.abspath(__file__))

    def resolve(path):
        path = path if os.path.isabs(path) else os.path.join(here, path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} does not exist: the data file of a task exported to {here}; "
                "export the tasks again (farsight eval passkey --export-choice DIR, farsight eval ruler --export DIR)"
            )
        return path

    if isinstance(data_files, str):
        data_files = {"test": data_files}
    files = {
        split: [resolve(p) for p in ([paths] if isinstance(paths, str) else paths)]
        for split, paths in data_files.items()
    }
    return datasets.load_dataset("json", data_files=files)
