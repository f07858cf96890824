"""Where a command will write, checked before it does any work: a folder that cannot be made there,
or a file in place of a folder, is refused at once naming the option, rather than failing on its
``mkdir`` after a model was built or a run trained."""

from __future__ import annotations

import os
from pathlib import Path

from tether.errors import ConfigError


def _existing_above(path: Path) -> Path:
    above = path.parent
    while not (above.exists() or above.is_symlink()) and above != above.parent:
        above = above.parent
    return above


def _creatable_under(path: Path, what: str, kind: str) -> None:
    above = _existing_above(path)
    if not above.is_dir():
        raise ConfigError(f"{what} {path} is under {above}, which is a file, not a folder; choose "
                          f"another {what}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: {above} is not writable, so the {kind} cannot be made there; "
                          f"choose another {what}")


def check_folder_to_write(path: Path | str, what: str) -> None:
    """Refuse a folder to write that cannot be: ``path`` is a file, lies under a file, or would be
    made in a folder that is not writable. ``what`` names the option (``--run-dir``, ``model.path``)."""
    if not str(path).strip():
        raise ConfigError(f"{what} is empty; give a folder to write")
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise ConfigError(f"{what} {path} exists and is not a folder; choose a new folder")
        return
    _creatable_under(path, what, "folder")


def check_file_to_write(path: Path | str, what: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse a file to write that cannot be: ``path`` is a folder, lies under a file or in a folder
    that is not writable, or (with ``suffixes``) has an extension the writer does not know."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; give a file name (for example {path / 'out'}"
                          f"{suffixes[0] if suffixes else ''})")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{what} {path}: the extension {path.suffix or '(none)'} is not one this writes; "
                          f"use one of {', '.join(suffixes)}")
    _creatable_under(path, what, "file")
