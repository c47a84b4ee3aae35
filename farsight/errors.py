"""farsight's error types: problems a user can fix (a bad argument, config, file or missing
package). The CLI prints these as one line; any other exception is a bug and keeps its traceback.

Each type also derives from the built-in exception it refines, so `except ValueError` keeps working.
"""

from __future__ import annotations


class FarsightError(Exception):
    """Base of every error whose message names the problem and the fix."""


class InputError(FarsightError, ValueError):
    """An argument or input (token ids, lengths, options) is invalid."""


class InputTypeError(FarsightError, TypeError):
    """An argument has the wrong type or dtype (e.g. an int64 tensor where floats belong)."""


class ConfigError(FarsightError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class ModelFileError(FarsightError, ValueError):
    """A model directory is missing, incomplete, corrupted or of another architecture."""


class MissingFileError(FarsightError, FileNotFoundError):
    """A file or directory the user named does not exist."""


class MissingDependencyError(FarsightError, ImportError):
    """An optional package is needed for what was asked; the message names the extra to install."""


class WriteError(FarsightError, OSError):
    """A file or folder could not be written (a full disk, no permission); the message names the
    path, and what was being written is left as it was before."""


class FolderInUseError(FarsightError, RuntimeError):
    """Another process is writing the folder (a training run, a dataset being prepared, an
    export); the message names that process and since when."""


class StateError(FarsightError, RuntimeError):
    """An object is used in a state that does not allow it (e.g. a closed session)."""


class BackendUnavailableError(FarsightError, RuntimeError):
    """The kernel backend asked for cannot run here (e.g. Triton without a GPU); the message names
    the backend that can."""


class UnsupportedModelError(FarsightError, TypeError):
    """The model's kind cannot do what was asked (e.g. retrieval inspection of a non-DRT model)."""
