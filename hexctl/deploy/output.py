"""The `--out` folder of `areal-hex deploy`: what may be written there, and writing it.

A render writes only into a folder that is new, empty, or one an earlier render wrote
(its marker file lists what that render wrote). An earlier render is replaced only with
`force`, and only when the folder holds nothing else: `kubectl apply` and compose read
whole folders, so a stranger's file beside the rendered ones would be applied with them.
Every check runs before anything is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_hex.errors import UsageError

MARKER = ".areal-hex-deploy"  # lists the files the last render wrote, one per line
SECRETS = "secrets"  # the folder that the rendered .gitignore and .dockerignore exclude
# Secret values live only under secrets/; git and Docker build contexts rooted at (or
# above, for git) the output folder never pick them up.
IGNORE_FILES = {
    ".gitignore": f"# written by areal-hex deploy: rendered secrets stay out of git\n{SECRETS}/\n",
    ".dockerignore": f"# written by areal-hex deploy\n{SECRETS}/\n{SECRETS}\n",
}


def written_before(out_dir: Path) -> list[str] | None:
    """Files an earlier render wrote into `out_dir`, or None when it did not render there."""
    marker = out_dir / MARKER
    if not marker.is_file():
        return None
    lines = marker.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse, before anything is written, an `--out` that is a file, a folder holding files
    this command did not write, or an earlier render without `force`."""
    for p in (out_dir, *out_dir.parents):
        if p.exists() and not p.is_dir():
            raise UsageError(
                f"--out {out_dir}: {p} is a file; expected a folder (a new one, an empty one, "
                "or one an earlier `areal-hex deploy` wrote)"
            )
        if p.exists():
            break
    if not out_dir.exists():
        return
    present = sorted(_files_under(out_dir))
    if not present:
        return
    ours = written_before(out_dir)
    if ours is None:
        raise UsageError(
            f"--out {out_dir} is not empty and was not written by areal-hex deploy (no "
            f"{MARKER} file); it holds {_some(present)}. Expected a new or empty folder: "
            "`kubectl apply` and compose would read those files with the rendered ones"
        )
    foreign = [f for f in present if f not in ours and f != MARKER]
    if foreign:
        raise UsageError(
            f"--out {out_dir} holds files areal-hex deploy did not write: {_some(foreign)}; "
            "move them elsewhere (they would be applied with the rendered manifests)"
        )
    if not force:
        raise UsageError(
            f"--out {out_dir} holds an earlier render; pass --force to replace its files "
            "(its secrets are kept)"
        )


def write_files(out_dir: Path, files: dict[str, str], private: set[str]) -> None:
    """Write `files` (relative path -> text), `private` ones 0600 in 0700 folders; remove
    the files an earlier render wrote that this one does not (a stale inference manifest
    would otherwise be applied again); record what was written in the marker."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in written_before(out_dir) or []:
        path = out_dir / name
        if name not in files and path.is_file() and _inside(out_dir, path):
            path.unlink()
    for name, text in files.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith(f"{SECRETS}/"):
            path.parent.chmod(0o700)
        mode = 0o600 if name in private else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        path.chmod(mode)
    header = "# files written by areal-hex deploy (re-render with --force)\n"
    (out_dir / MARKER).write_text(header + "\n".join(sorted(files)) + "\n")


def _files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            out.append((Path(dirpath) / n).relative_to(root).as_posix())
    return out


def _inside(root: Path, path: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _some(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
