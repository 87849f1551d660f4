"""The agent's side of MIG and power: profiles and layouts, what it reports of its GPUs (fake
ones, and NVML through a stand-in), the nvidia-smi commands that change a layout, layouts applied
in fake mode, and the command line that fakes them (a job's environment on a share of a GPU:
``test_agent_shares``)."""

from __future__ import annotations

import os
import stat
import time
from types import SimpleNamespace
from typing import Any

import pytest

from clusters.agent import mig
from clusters.agent.__main__ import main
from clusters.agent.agent import Agent
from clusters.agent.runner import Refused
from clusters.agent.telemetry import Gpus, node_power_w

NODE = "n1"
A100_80 = "NVIDIA A100-SXM4-80GB"


class StandInNvml:
    """A stand-in for ``pynvml``, because no GPU and no NVIDIA driver is on the machines the tests
    run on. It answers the NVML calls the agent makes, for GPUs given as dicts, with NVML's
    error classes where a real GPU or driver raises them: ``NotSupported`` for a reading a GPU
    cannot give (no ``mig`` key: a GPU without MIG), ``NotFound`` for an empty MIG slot."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus = gpus

    def _gpu(self, handle: tuple) -> dict[str, Any]:
        gpu = self.gpus[handle[1]]
        return gpu["mig"]["slots"][handle[2]] if handle[0] == "mig" else gpu

    def _given(self, handle: tuple, key: str) -> Any:
        value = self._gpu(handle).get(key)
        if value is None:
            raise self.NVMLError_NotSupported(key)
        return value

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple:
        return ("gpu", index)

    def nvmlDeviceGetName(self, handle: tuple) -> bytes:
        return self._given(handle, "name").encode()  # older pynvml answers bytes

    def nvmlDeviceGetUUID(self, handle: tuple) -> str:
        return self._given(handle, "uuid")

    def nvmlDeviceGetMemoryInfo(self, handle: tuple) -> SimpleNamespace:
        total = self._given(handle, "memory_mb") * 2**20
        return SimpleNamespace(total=total, used=self._gpu(handle).get("used_mb", 0) * 2**20)

    def nvmlDeviceGetUtilizationRates(self, handle: tuple) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._given(handle, "util"))

    def nvmlDeviceGetPowerUsage(self, handle: tuple) -> int:
        return self._given(handle, "power_mw")

    def nvmlDeviceGetTemperature(self, handle: tuple, sensor: int) -> int:
        return self._given(handle, "temp")

    def nvmlDeviceGetMigMode(self, handle: tuple) -> list[int]:
        mode = self._given(handle, "mig")["mode"]
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: tuple) -> int:
        count = self._given(handle, "mig")["max"]
        if isinstance(count, Exception):
            raise count
        return count

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: tuple, slot: int) -> tuple:
        if slot not in self._given(handle, "mig")["slots"]:
            raise self.NVMLError_NotFound(slot)
        return ("mig", handle[1], slot)


def instance(profile: str, uuid_: str, memory_mb: int) -> dict[str, Any]:
    return {"name": f"{A100_80} MIG {profile}", "uuid": uuid_, "memory_mb": memory_mb}


def nvml_machine() -> StandInNvml:
    """GPU 0 in MIG mode (slot 1 empty), GPU 1 without MIG support, GPU 2 in MIG mode without a
    readable layout size."""
    mig_gpu = {
        "mode": 1,
        "max": 7,
        "slots": {0: instance("1g.10gb", "MIG-aaaa", 9728), 2: instance("3g.40gb+me", "MIG-cccc", 40192)},
    }
    return StandInNvml(
        [
            {"name": A100_80, "uuid": "GPU-0", "memory_mb": 81920, "used_mb": 5, "power_mw": 61500,
             "temp": 33, "mig": mig_gpu},  # MIG mode: no utilisation
            {"name": A100_80, "uuid": "GPU-1", "memory_mb": 81920, "used_mb": 40000, "util": 97,
             "power_mw": 390250, "temp": 71},
            {"name": A100_80, "uuid": "GPU-2", "memory_mb": 81920,
             "mig": {"mode": 1, "max": StandInNvml.NVMLError("unknown error"), "slots": {}}},
        ]
    )  # fmt: skip


# --- profiles and layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "slices"),
    [
        ("1g.10gb", 1),
        ("1g.10gb+me", 1),
        ("3g.40gb", 3),
        ("7g.80gb", 7),
        ("7g.141gb", 7),
        ("1g.12gb-me", 1),
        ("1g.20gb+gfx", 1),
    ],
)
def test_a_profile_says_its_slices(profile, slices):
    assert mig.slices(profile) == slices


@pytest.mark.parametrize(
    "profile",
    ["", "0g.10gb", "9g.10gb", "1g.0gb", "1g.10000gb", "1c.3g.20gb", "1g.10GB", "1g.10gb+", " 1g.10gb",
     7, None],
    ids=["empty", "no-slices", "too-many-slices", "no-memory", "huge", "compute-instance", "caps", "suffix",
         "space", "number", "none"],
)  # fmt: skip
def test_what_is_not_a_profile_is_refused(profile):
    with pytest.raises(mig.LayoutError, match="not a MIG profile"):
        mig.slices(profile)


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        (["1g.10gb"] * 9, "at most 8 profiles"),
        (["7g.80gb", "3g.40gb"], "10 compute slices"),
        ("1g.10gb", "a list"),
        (["1g.10gb", "2g"], "not a MIG profile"),
    ],
    ids=["too-many", "too-big", "not-a-list", "bad-profile"],
)
def test_a_layout_that_cannot_be_is_refused(layout, words):
    with pytest.raises(mig.LayoutError, match=words):
        mig.check_layout(layout)


@pytest.mark.parametrize(
    ("spec", "layouts"),
    [
        ("0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb", {0: ["1g.10gb", "1g.10gb", "3g.40gb"], 1: ["7g.80gb"]}),
        (" 2 : 3g.40gb , 3g.40gb ; ", {2: ["3g.40gb", "3g.40gb"]}),
        ("0:", {0: []}),
        ("", {}),
    ],
    ids=["two-gpus", "spaces", "mig-on-no-instances", "nothing"],
)
def test_fake_mig_layouts_are_read(spec, layouts):
    assert mig.parse_fake_mig(spec) == layouts


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("1g.10gb", "expected GPU:PROFILE"),
        ("x:1g.10gb", "expected GPU:PROFILE"),
        ("64:1g.10gb", "expected GPU:PROFILE"),
        ("0:1g.10gb;0:7g.80gb", "GPU 0 appears twice"),
        ("0:1g.10gb,banana", "not a MIG profile"),
        ("0:" + ",".join(["1g.10gb"] * 9), "at most 8"),
    ],
    ids=["no-index", "not-a-number", "index-too-high", "twice", "bad-profile", "too-many"],
)
def test_a_bad_fake_mig_layout_says_what_is_wrong(spec, words):
    with pytest.raises(mig.LayoutError, match=words):
        mig.parse_fake_mig(spec)


@pytest.mark.parametrize(
    ("layout", "mig_on", "commands"),
    [
        (
            ["3g.40gb", "3g.40gb"],
            True,
            [["mig", "-i", "1", "-dci"], ["mig", "-i", "1", "-dgi"],
             ["mig", "-i", "1", "-cgi", "3g.40gb,3g.40gb", "-C"]],
        ),
        (
            ["7g.80gb"],
            False,
            [["-i", "1", "-mig", "1"], ["mig", "-i", "1", "-dci"], ["mig", "-i", "1", "-dgi"],
             ["mig", "-i", "1", "-cgi", "7g.80gb", "-C"]],
        ),
        ([], True, [["mig", "-i", "1", "-dci"], ["mig", "-i", "1", "-dgi"], ["-i", "1", "-mig", "0"]]),
        ([], False, []),
    ],
    ids=["relayout", "mig-on-first", "mig-off", "already-off"],
)  # fmt: skip
def test_the_commands_that_change_a_layout_are_argv_lists(layout, mig_on, commands):
    made = mig.reconfigure_commands("/usr/bin/nvidia-smi", 1, layout, mig_on)
    assert [c[0] for c in made] == ["/usr/bin/nvidia-smi"] * len(commands)
    assert [c[1:] for c in made] == commands


def test_a_profile_is_read_from_an_nvml_device_name():
    assert mig.profile_of_name(f"{A100_80} MIG 1g.10gb") == "1g.10gb"
    assert mig.profile_of_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert mig.profile_of_name(A100_80) is None


# --- fake GPUs --------------------------------------------------------------------------------------


def test_fake_gpus_report_their_mig_instances_with_stable_uuids():
    layouts = {0: ["1g.10gb", "1g.10gb", "3g.40gb"]}
    described = Gpus("a100:2", NODE, fake_mig=layouts).describe()
    assert described == Gpus("a100:2", NODE, fake_mig=layouts).describe()  # a restart reports the same
    assert "mig" not in described[1]
    instances = described[0]["mig"]
    assert [(m["slot"], m["profile"], m["memory_mb"], m["slices"]) for m in instances] == [
        (0, "1g.10gb", 9984, 1),
        (1, "1g.10gb", 9984, 1),
        (2, "3g.40gb", 40704, 3),
    ]
    assert len({m["uuid"] for m in instances}) == 3
    assert all(m["uuid"].startswith("MIG-fake-") and mig.MIG_UUID.fullmatch(m["uuid"]) for m in instances)
    other_node = Gpus("a100:2", "n2", fake_mig=layouts).describe()[0]["mig"]
    assert not {m["uuid"] for m in instances} & {m["uuid"] for m in other_node}


def test_fake_gpus_draw_power_and_memory_when_busy():
    gpus = Gpus("a100:3", NODE, fake_mig={2: ["3g.40gb", "3g.40gb"]}, fake_power=(50.0, 350.0))
    idle = gpus.telemetry(set())
    assert [(g["util"], g["power_w"], g["memory_used_mb"], g["temp_c"]) for g in idle] == [
        (0.0, 50.0, 0, 34.0)
    ] * 3
    busy = gpus.telemetry({0, 2})  # GPU 2: one of its instances is busy, so the GPU is
    assert [(g["util"], g["power_w"]) for g in busy] == [(100.0, 350.0), (0.0, 50.0), (100.0, 350.0)]
    assert busy[0]["memory_used_mb"] == 16384
    assert busy[2]["memory_used_mb"] == 2 * 40704 * 3 // 4
    assert busy[0]["temp_c"] > busy[1]["temp_c"]
    assert node_power_w(busy) == 750.0


def test_node_power_is_the_gpus_sum_and_nothing_made_up():
    assert node_power_w([{"power_w": 61.5}, {"power_w": 390.25}, {}]) == 451.8
    assert node_power_w([{"util": 3.0}, {}]) is None
    assert node_power_w([]) is None


# --- NVML, through the stand-in -------------------------------------------------------------------


def test_nvml_gpus_in_mig_mode_report_their_instances():
    described = Gpus(None, NODE, nvml=nvml_machine()).describe()
    assert [g["model"] for g in described] == [A100_80] * 3
    assert described[0]["mig"] == [
        {"slot": 0, "uuid": "MIG-aaaa", "memory_mb": 9728, "profile": "1g.10gb", "slices": 1},
        {"slot": 2, "uuid": "MIG-cccc", "memory_mb": 40192, "profile": "3g.40gb+me", "slices": 3},
    ]
    assert "mig" not in described[1]  # no MIG support: NotSupported on its mode
    assert "mig" not in described[2]  # its MIG slots cannot be counted: no layout is made up


def test_an_nvml_instance_without_a_profile_in_its_name_is_left_out():
    machine = nvml_machine()
    machine.gpus[0]["mig"]["slots"][0]["name"] = "NVIDIA A100-SXM4-80GB MIG 1c.7g.80gb?"
    assert [m["slot"] for m in Gpus(None, NODE, nvml=machine).describe()[0]["mig"]] == [2]


def test_nvml_telemetry_leaves_out_what_a_gpu_cannot_say():
    gpus = Gpus(None, NODE, nvml=nvml_machine())
    readings = gpus.telemetry(set())
    assert "util" not in readings[0]  # a GPU in MIG mode has no utilisation in NVML
    assert readings[0]["power_w"] == 61.5 and readings[1]["power_w"] == 390.25
    assert readings[1] | {} == {
        "index": 1, "uuid": "GPU-1", "util": 97.0, "memory_total_mb": 81920, "memory_used_mb": 40000,
        "power_w": 390.25, "temp_c": 71.0, "health": "healthy",
    }  # fmt: skip
    assert "power_w" not in readings[2] and "temp_c" not in readings[2]
    assert node_power_w(readings) == 451.8
    assert gpus.layout(0) == ["1g.10gb", "3g.40gb+me"] and gpus.layout(1) is None


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """A stand-in ``nvidia-smi`` on the PATH (no driver here) that records its arguments, one
    call a line, and exits as ``$STAND_IN_EXIT_<word>`` says for a call naming that word."""
    calls = tmp_path / "calls"
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'for word in "$@"; do\n'
        '  code=$(printenv "STAND_IN_EXIT_$(echo "$word" | tr -dc A-Za-z)")\n'
        '  if [ -n "$code" ]; then echo "refused $word" >&2; exit "$code"; fi\n'
        "done\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    return lambda: calls.read_text().splitlines() if calls.exists() else []


def test_a_real_gpu_gets_its_layout_from_nvidia_smi(nvidia_smi, monkeypatch):
    monkeypatch.setenv("STAND_IN_EXIT_dci", "6")  # nothing to destroy: not a failure
    Gpus(None, NODE, nvml=nvml_machine()).reconfigure(0, ["3g.40gb", "3g.40gb"])
    assert nvidia_smi() == ["mig -i 0 -dci", "mig -i 0 -dgi", "mig -i 0 -cgi 3g.40gb,3g.40gb -C"]


def test_a_layout_the_driver_refuses_is_an_error_with_its_words(nvidia_smi, monkeypatch):
    monkeypatch.setenv("STAND_IN_EXIT_cgi", "2")
    with pytest.raises(OSError, match=r"-cgi 7g\.80gb -C exited 2: refused -cgi"):
        Gpus(None, NODE, nvml=nvml_machine()).reconfigure(1, ["7g.80gb"])
    assert nvidia_smi()[0] == "-i 1 -mig 1"  # GPU 1 was not in MIG mode


@pytest.mark.parametrize(
    ("index", "layout", "error"),
    [
        (5, ["1g.10gb"], LookupError),
        (0, ["1g.10gb; reboot"], mig.LayoutError),
        (0, "7g.80gb", mig.LayoutError),
    ],
    ids=["no-such-gpu", "injection", "not-a-list"],
)
def test_a_layout_change_that_cannot_be_runs_nothing(nvidia_smi, index, layout, error):
    with pytest.raises(error):
        Gpus(None, NODE, nvml=nvml_machine()).reconfigure(index, layout)
    assert nvidia_smi() == []


# --- layouts applied in fake mode ---------------------------------------------------------------------


@pytest.fixture
def agent(tmp_path) -> Agent:
    """An agent with two fake A100s, GPU 0 in MIG mode; no server is asked anything here."""
    return Agent(
        "http://127.0.0.1:9",
        tmp_path / "work",
        name=NODE,
        fake_gpus="a100:2",
        fake_mig={0: ["1g.10gb"] * 7},
        use_cgroups=False,
    )


def test_an_idle_gpu_takes_the_layout_asked_for_and_the_node_describes_itself_again(agent):
    agent._apply_layouts(
        [{"gpu": 0, "profiles": ["3g.40gb", "4g.40gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}]
    )
    assert agent.gpus.layout(0) == ["3g.40gb", "4g.40gb"] and agent.gpus.layout(1) == ["7g.80gb"]
    assert agent.describe_due
    described = {g["index"]: g.get("mig") for g in agent._description()["gpus"]}
    assert [m["profile"] for m in described[1]] == ["7g.80gb"]
    agent._apply_layouts([{"gpu": 0, "profiles": []}])
    assert agent.gpus.layout(0) is None and "mig" not in agent.gpus.describe()[0]


def test_a_layout_already_there_changes_nothing(agent):
    agent._apply_layouts([{"gpu": 0, "profiles": ["1g.10gb"] * 7}, {"gpu": 1, "profiles": []}])
    assert not agent.describe_due and agent.gpus.layout(1) is None


def test_a_server_that_keeps_asking_for_a_layout_the_node_has_is_told_again(agent):
    """It kept an instance a job held when the layout changed: once the job has ended, the next
    description (at most a minute later) lets it catch up."""
    agent.described_at = time.monotonic() - 61
    agent._apply_layouts([{"gpu": 0, "profiles": ["1g.10gb"] * 7}])
    assert agent.describe_due and agent.gpus.layout(0) == ["1g.10gb"] * 7


def test_a_gpu_an_attempt_holds_or_is_about_to_keeps_its_layout(agent):
    agent._desired_cache = {"a": {"attempt": "a", "gpus": [0], "mig_uuids": ["MIG-x"]}}
    agent._apply_layouts([{"gpu": 0, "profiles": ["7g.80gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}])
    assert agent.gpus.layout(0) == ["1g.10gb"] * 7 and agent.gpus.layout(1) == ["7g.80gb"]
    agent._desired_cache = {}
    agent._apply_layouts([{"gpu": 0, "profiles": ["7g.80gb"]}])
    assert agent.gpus.layout(0) == ["7g.80gb"]


@pytest.mark.parametrize(
    "asked",
    [
        [{"gpu": 1, "profiles": ["8g.90gb", "1g.10gb"]}],
        [{"gpu": 1, "profiles": "7g.80gb"}],
        [{"gpu": True, "profiles": ["7g.80gb"]}],
        [{"gpu": 9, "profiles": ["7g.80gb"]}],
        [{"profiles": ["7g.80gb"]}],
        ["7g.80gb"],
        {"gpu": 1},
    ],
    ids=[
        "too-many-slices",
        "not-a-list",
        "bool-index",
        "no-such-gpu",
        "no-gpu",
        "not-an-object",
        "not-a-list-at-all",
    ],
)
def test_a_layout_the_agent_cannot_take_is_ignored(agent, asked):
    agent._apply_layouts(asked)
    assert agent.gpus.layout(1) is None and agent.gpus.layout(0) == ["1g.10gb"] * 7
    assert not agent.describe_due


def test_an_attempt_on_mig_instances_the_node_lacks_is_refused(agent):
    present = agent.gpus.describe()[0]["mig"][3]["uuid"]
    agent._check_instances({"mig_uuids": [present]})
    with pytest.raises(Refused, match="no MIG instance MIG-gone"):
        agent._check_instances({"mig_uuids": [present, "MIG-gone"]})


# --- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--fake-mig", "0:1g.10gb"], "--fake-mig needs --fake-gpus"),
        (["--fake-gpus", "a100:2", "--fake-mig", "2:1g.10gb"], "no GPU 2 among the 2 fake ones"),
        (["--fake-gpus", "a100:2", "--fake-mig", "0:1g.10gb,9g.1gb"], "not a MIG profile"),
        (["--fake-gpus", "a100:x"], "expected MODEL:COUNT"),
        (["--fake-gpus", "a100:1", "--fake-power", "400:60"], "expected IDLE:BUSY"),
        (["--fake-gpus", "a100:1", "--fake-power", "60"], "expected IDLE:BUSY"),
        (["--fake-gpus", "a100:1", "--fake-power", "nan:inf"], "expected IDLE:BUSY"),
    ],
    ids=[
        "mig-without-gpus",
        "no-such-gpu",
        "bad-profile",
        "bad-count",
        "idle-above-busy",
        "one-number",
        "nan",
    ],
)
def test_bad_fake_options_end_the_agent_with_a_usage_error(tmp_path, capsys, args, said):
    with pytest.raises(SystemExit) as ended:
        main(["--server", "http://127.0.0.1:9", "--work-dir", str(tmp_path), *args])
    assert ended.value.code == 2 and said in capsys.readouterr().err


def test_the_help_tells_how_to_fake_mig_and_power(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert "--fake-mig" in out and "0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb" in out.replace(" ", "")
    assert "--fake-power" in out and "60:400" in out
