"""Progress bars for long loops (training, tokenizing, evaluating), with one switch for all.

Every bar in farsight comes from `progress_bar`, so `show_progress_bars(False)` (what
`farsight -q` does) silences them all, while a loop's own `disable=` still turns its bar off.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

_enabled = True


def show_progress_bars(enabled: bool) -> None:
    """Turn every farsight progress bar on or off (they are on by default)."""
    global _enabled
    _enabled = bool(enabled)


def progress_bars_shown() -> bool:
    return _enabled


def progress_bar(*args: Any, disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar (same arguments), off when the caller disables it or bars are switched off."""
    return tqdm(*args, disable=disable or not _enabled, **kwargs)
