"""The `--out` folder of `areal-hex deploy`: what may be written there, and writing it.

A render writes only into a folder that is new, empty, or one an earlier render wrote
(its marker file lists what that render wrote). An earlier render is replaced only with
`force`, and only when the folder holds nothing else: `kubectl apply` and compose read
whole folders, so a stranger's file beside the rendered ones would be applied with them.
Every check runs before anything is written.
"""

from __future__ import annotations

import fnmatch
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


# Files a target's job itself writes beside the render (the Slurm job's log and its
# runtime config), which a re-render leaves alone: no tool reads the folder whole there.
JOB_OUTPUT = {"slurm": ("slurm-*.out", "runtime/*")}
# Why a stranger's file in the folder is refused, per target.
WHY_EMPTY = {
    "k8s": "`kubectl apply -k` would apply it with the rendered manifests",
    "compose": "compose would read it with the rendered files",
    "slurm": "the job reads its config and secrets from this folder",
}


def check_out_dir(out_dir: Path, force: bool, target: str = "k8s") -> None:
    """Refuse, before anything is written, an `--out` that is a file, a folder holding files
    this command did not write (besides what the target's job writes there), a link
    leading out of it, or an earlier render without `force`."""
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
    refuse_links(out_dir)
    job_output = JOB_OUTPUT.get(target, ())
    present = sorted(
        f for f in _files_under(out_dir) if not any(fnmatch.fnmatch(f, g) for g in job_output)
    )
    if not present:
        return
    ours = written_before(out_dir)
    why = WHY_EMPTY.get(target, WHY_EMPTY["k8s"])
    if ours is None:
        raise UsageError(
            f"--out {out_dir} is not empty and was not written by areal-hex deploy (no "
            f"{MARKER} file); it holds {_some(present)}. Expected a new or empty folder: "
            f"{why}"
        )
    foreign = [f for f in present if f not in ours and f != MARKER]
    if foreign:
        raise UsageError(
            f"--out {out_dir} holds files areal-hex deploy did not write: {_some(foreign)}; "
            f"move them elsewhere ({why})"
        )
    if not force:
        raise UsageError(
            f"--out {out_dir} holds an earlier render; pass --force to replace its files "
            "(its secrets are kept)"
        )


def refuse_links(out_dir: Path) -> None:
    """No symbolic link anywhere under `out_dir` (files or folders such as `secrets/`):
    a write through one would land outside the folder (a --force re-render overwriting
    whatever it points at), and a link inside it could be swapped for one later."""
    links = sorted(
        (Path(dirpath) / n).relative_to(out_dir).as_posix()
        for dirpath, dirs, names in os.walk(out_dir)
        for n in [*dirs, *names]
        if (Path(dirpath) / n).is_symlink()
    )
    if links:
        raise UsageError(
            f"--out {out_dir} holds symbolic links: {_some(links)}; expected plain files and "
            "folders (a write through a link would land outside --out): remove them"
        )


def write_files(out_dir: Path, files: dict[str, str], private: set[str]) -> None:
    """Write `files` (relative path -> text), `private` ones 0600 in 0700 folders; remove
    the files an earlier render wrote that this one does not (a stale inference manifest
    would otherwise be applied again); record what was written in the marker. Nothing is
    written through a symbolic link (`check_out_dir` refused them; O_NOFOLLOW and the
    folder checks here also catch one made in between)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(out_dir)
    for name in written_before(out_dir) or []:
        path = out_dir / name
        if name not in files and path.is_file() and not path.is_symlink():
            path.unlink()
    for name, text in {**files, MARKER: _marker(files)}.items():
        _write_one(out_dir, name, text, 0o600 if name in private else 0o644)


def _marker(files: dict[str, str]) -> str:
    header = "# files written by areal-hex deploy (re-render with --force)\n"
    return header + "\n".join(sorted(files)) + "\n"


def _write_one(out_dir: Path, name: str, text: str, mode: int) -> None:
    path = out_dir / name
    for folder in reversed(path.relative_to(out_dir).parents[:-1]):  # e.g. secrets/
        sub = out_dir / folder
        if sub.is_symlink():
            raise UsageError(f"--out {out_dir}: {folder} is a symbolic link; expected a folder")
        sub.mkdir(exist_ok=True)
        if folder.as_posix() == SECRETS:
            sub.chmod(0o700)
    # O_NOFOLLOW: fail rather than write through a link at the file itself
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot write {name}: {exc.strerror}") from exc
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), mode)  # an existing file keeps its mode through O_CREAT
        fh.write(text)


def _files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            out.append((Path(dirpath) / n).relative_to(root).as_posix())
    return out


def _some(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
