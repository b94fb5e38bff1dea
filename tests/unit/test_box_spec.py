from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError
from hexctl.box.spec import load_box

KINDS = {
    "fast": {"cpu": 0.9, "max_running_requests": 8, "usd_per_hour": 3.0, "nic_mbit": 100},
    "mem": {"cpu": 0.4, "max_running_requests": 64, "usd_per_hour": 1.0, "nic_mbit": 100},
}


def _write(tmp: Path, **data) -> Path:
    base = {
        "name": "mix",
        "kinds": KINDS,
        "racks": [
            {
                "name": "a",
                "uplink_mbit": 50,
                "members": [{"kind": "fast", "count": 1}, {"kind": "mem", "first": 1, "count": 1}],
            },
            {"name": "b", "uplink_mbit": 50, "members": [{"kind": "mem", "first": 0, "count": 1}]},
        ],
    }
    base.update(data)
    p = tmp / "box.yaml"
    p.write_text(yaml.safe_dump(base))
    return p


def test_nodes_follow_the_host_file_numbering(tmp_path: Path) -> None:
    box = load_box(_write(tmp_path))
    assert [(n.name, box.spec.racks[n.rack].name) for n in box.nodes] == [
        ("fast-0", "a"),
        ("mem-1", "a"),
        ("mem-0", "b"),
    ]
    addresses = {box.address(n) for n in box.nodes} | {box.host_address}
    assert len(addresses) == 4 and all(a.startswith("10.91.") for a in addresses)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "toolongname"}, "name"),
        ({"subnet": "10.0.0.0/30"}, "subnet: 10.0.0.0/30 holds 4 addresses"),
        (
            {"racks": [{"name": "a", "uplink_mbit": 1, "members": [{"kind": "gpu", "count": 1}]}]},
            "unknown kind 'gpu'",
        ),
        (
            {
                "racks": [
                    {
                        "name": "a",
                        "uplink_mbit": 1,
                        "members": [{"kind": "mem", "first": 1, "count": 1}],
                    }
                ]
            },
            "without gaps",
        ),
        (
            {"racks": [{"name": "a", "uplink_mbit": 0, "members": [{"kind": "mem", "count": 1}]}]},
            "uplink_mbit",
        ),
    ],
)
def test_bad_boxes_name_the_field(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as got:
        load_box(_write(tmp_path, **change))
    assert str(got.value).startswith("invalid box (")  # the file is called what it is


def test_the_shipped_boxes_and_their_job_load() -> None:
    from areal_hex.config import load_config

    root = Path(__file__).resolve().parents[2]
    mix, thin = (load_box(root / f"examples/box/{n}.yaml") for n in ("mix", "thin"))
    assert {n.kind for n in mix.nodes} == {"fast", "mem"} and len(thin.spec.racks) == 2
    # thin numbers its nodes across the racks: first-fit's first nodes are in two racks
    rack = {n.name: thin.spec.racks[n.rack].name for n in thin.nodes}
    assert rack["fast-0"] != rack["mem-0"]
    cfg = load_config(root / "examples/box/tiny_box.yaml")
    assert cfg.run.pin_cores is False and cfg.run.box is None
