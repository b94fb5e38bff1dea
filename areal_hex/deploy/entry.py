"""Container entry point: add the Secret's values to the mounted config, then exec the
service's real command.

    python -m areal_hex.deploy.entry --config /etc/areal-hex/config.yaml \
        --secrets /run/secrets/areal-hex --out /tmp/areal-hex/config.yaml \
        -- areal-hex serve {config} --index 0

The ConfigMap (or compose config) holds no secrets; the Redis password and the service
token arrive as files (`redis-password`, `api-token`) and go into a private copy of the
config (mode 0600), so they never show in manifests, environments or command lines.
`{config}` in the command is replaced by that copy's path.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from areal_hex.layout import CONFIG_PLACEHOLDER

# Secret file name -> (config section, key).
SECRET_FIELDS = {
    "redis-password": ("redis", "password"),
    "api-token": ("inference", "api_key"),
}


def write_runtime_config(config: Path, secrets_dir: Path, out: Path) -> Path:
    """Copy `config` to `out` (0600) with every secret file found in `secrets_dir` set."""
    data = yaml.safe_load(config.read_text()) or {}
    for name, (section, key) in SECRET_FIELDS.items():
        f = secrets_dir / name
        if f.is_file():
            data.setdefault(section, {})[key] = f.read_text().strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_hex.deploy.entry")
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--secrets", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given after --")
    if not args.config.is_file():
        print(f"areal-hex entry: config not found: {args.config}", file=sys.stderr)
        return 2
    out = write_runtime_config(args.config, args.secrets, args.out)
    argv_out = [a.replace(CONFIG_PLACEHOLDER, str(out)) for a in cmd]
    sys.stdout.flush()
    os.execvp(argv_out[0], argv_out)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
