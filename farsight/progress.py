"""Progress bars for long loops (training, tokenizing, evaluating), with one switch for all.

Every bar in farsight comes from `progress_bar`, so `show_progress_bars(False)` (what
`farsight -q` does) silences them all, while a loop's own `disable=` still turns its bar off.
"""

from __future__ import annotations

import weakref
from typing import Any

from tqdm.auto import tqdm

_enabled = True
_bars: weakref.WeakSet[tqdm] = weakref.WeakSet()  # the bars progress_bar made that still exist


def show_progress_bars(enabled: bool) -> None:
    """Turn every farsight progress bar on or off (they are on by default)."""
    global _enabled
    _enabled = bool(enabled)


def progress_bars_shown() -> bool:
    return _enabled


def progress_bar(*args: Any, disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar (same arguments), off when the caller disables it or bars are switched off."""
    bar = tqdm(*args, disable=disable or not _enabled, **kwargs)
    _bars.add(bar)
    return bar


def close_progress_bars() -> None:
    """Close every bar still open (drawn as it stopped, ending its line), so that what a command
    prints when a loop stops with an error starts a line of its own and no bar redraws after it."""
    for bar in list(_bars):
        bar.close()
