"""Container entry point: add the Secret's values to the mounted config, then exec the
service's real command.

    python -m hexctl.runtime.entry --config /etc/areal-hex/config.yaml \
        --secrets /run/secrets/areal-hex --out /tmp/areal-hex/config.yaml \
        -- areal-hex serve {config} --index 0

The ConfigMap (or compose config) holds no secrets; the Redis password and the service
token arrive as files (`redis-password`, `api-token`) and go into a private copy of the
config (mode 0600), so they never show in manifests, environments or command lines.
`{config}` in the command is replaced by that copy's path.

With `--sglang-config PATH` (inference containers of the SGLang backend) the token goes
instead to PATH (0600), a YAML file SGLang reads with `--config` (its `api-key`), which
the copy adds to `inference.sglang.extra_args`: `areal-hex serve` would otherwise pass
it to SGLang as `--api-key TOKEN`, readable in the process list.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from areal_hex.config.base import load_yaml_text
from hexctl.job.layout import CONFIG_PLACEHOLDER

# Secret file name -> (config section, key).
SECRET_FIELDS = {
    "redis-password": ("redis", "password"),
    "api-token": ("inference", "api_key"),
}


def write_runtime_config(
    config: Path, secrets_dir: Path, out: Path, sglang_config: Path | None = None
) -> Path:
    """Copy `config` to `out` (0600) with every secret file found in `secrets_dir` set;
    with `sglang_config`, an SGLang server's token goes to that file instead."""
    data = load_yaml_text(config.read_text(), str(config)) or {}
    for name, (section, key) in SECRET_FIELDS.items():
        f = secrets_dir / name
        if f.is_file():
            data.setdefault(section, {})[key] = f.read_text().strip()
    inf = data.get("inference", {})
    if sglang_config is not None and inf.get("backend") == "sglang" and inf.get("api_key"):
        _write_private(sglang_config, yaml.safe_dump({"api-key": inf.pop("api_key")}))
        sglang = inf.setdefault("sglang", {})
        sglang["extra_args"] = [*sglang.get("extra_args", []), "--config", str(sglang_config)]
    return _write_private(out, yaml.safe_dump(data, sort_keys=False))


def _write_private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hexctl.runtime.entry")
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--secrets", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sglang-config", type=Path, help="SGLang --config file for the API key")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given after --")
    if not args.config.is_file():
        print(f"areal-hex entry: config not found: {args.config}", file=sys.stderr)
        return 2
    out = write_runtime_config(args.config, args.secrets, args.out, args.sglang_config)
    argv_out = [a.replace(CONFIG_PLACEHOLDER, str(out)) for a in cmd]
    sys.stdout.flush()
    os.execvp(argv_out[0], argv_out)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
