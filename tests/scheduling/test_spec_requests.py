"""What a spec asks for beyond one GPU model (scheduling/spec.py): GPUs of any model, with or
without a list of models in order of preference, and how a job wants to be preempted. Every
form a user may write, and every bad shape refused with the path of the field at fault. Pure
functions: no database."""

from __future__ import annotations

import pytest

from scheduling.services.preemption import stop_terms
from scheduling.spec import MAX_GPU_MODELS, GpuRequest, parse_job_spec
from tests.scheduling.test_spec import refusals, spec_with

GPUS = "spec__resources__gpus"

GPU_FORMS = [
    ("bare-integer-is-any-model", 1, GpuRequest(None, 1)),
    ("bare-eight", 8, GpuRequest(None, 8)),
    ("digit-string", "1", GpuRequest(None, 1)),
    ("digit-string-padded", " 4 ", GpuRequest(None, 4)),
    ("gres-count", "gpu:1", GpuRequest(None, 1)),
    ("gres-count-upper", "GPU:2", GpuRequest(None, 2)),
    ("gres-alone-is-one", "gpu", GpuRequest(None, 1)),
    ("count-only", {"count": 2}, GpuRequest(None, 2)),
    ("preference", {"count": 2, "models": ["h100", "A100"]}, GpuRequest(None, 2, ("h100", "a100"))),
    ("preference-count-defaults-to-one", {"models": ["l40s"]}, GpuRequest(None, 1, ("l40s",))),
    ("empty-preference-is-any", {"count": 3, "models": []}, GpuRequest(None, 3)),
    ("zero-count-drops-the-models", {"count": 0, "models": ["h100"]}, GpuRequest(None, 0)),
    ("zero", 0, GpuRequest(None, 0)),
    ("zero-string", "0", GpuRequest(None, 0)),
    # Every form that names one model still means that model.
    ("model-count", "h100:8", GpuRequest("h100", 8)),
    ("gres-model-count", "gpu:h100:8", GpuRequest("h100", 8)),
    ("model-alone-is-one", "h100", GpuRequest("h100", 1)),
    ("model-mapping", {"model": "H100", "count": 2}, GpuRequest("h100", 2)),
    ("model-zero", "h100:0", GpuRequest(None, 0)),
]


@pytest.mark.parametrize("value, expected", [f[1:] for f in GPU_FORMS], ids=[f[0] for f in GPU_FORMS])
def test_gpu_forms(value, expected):
    gpus = parse_job_spec(spec_with(**{GPUS: value})).gpus
    assert gpus == expected
    assert gpus.any_model == (expected.count > 0 and expected.model is None)


BAD_GPUS = [
    ("negative-integer", -2, "spec.resources.gpus", "cannot be negative, got -2"),
    ("over-a-node", 65, "spec.resources.gpus", "more than 64 GPUs per node"),
    ("negative-gres", "gpu:-1", "spec.resources.gpus", "cannot be negative"),
    ("float", 1.5, "spec.resources.gpus", "not a number"),
    ("boolean", True, "spec.resources.gpus", "not a boolean"),
    ("list", ["h100"], "spec.resources.gpus", "not a list"),
    ("three-parts", "gpu:h100:8:1", "spec.resources.gpus", "is not a GPU request"),
    ("empty-mapping", {}, "spec.resources.gpus", "give count"),
    ("count-as-text", {"count": "2"}, "spec.resources.gpus", "count must be an integer"),
    ("count-boolean", {"count": True, "models": ["h100"]}, "spec.resources.gpus", "must be an integer"),
    ("unknown-key", {"count": 1, "type": "h100"}, "spec.resources.gpus", "unknown key(s) type"),
    (
        "model-and-models",
        {"model": "h100", "models": ["a100"], "count": 1},
        "spec.resources.gpus.models",
        "not both",
    ),
    ("models-not-a-list", {"count": 1, "models": "h100,a100"}, "spec.resources.gpus.models", "a list"),
    ("models-null", {"count": 1, "models": None}, "spec.resources.gpus.models", "not null"),
    (
        "too-many-models",
        {"count": 1, "models": [f"m{i}" for i in range(MAX_GPU_MODELS + 1)]},
        "spec.resources.gpus.models",
        f"at most {MAX_GPU_MODELS}",
    ),
    ("model-not-text", {"count": 1, "models": ["h100", 7]}, "spec.resources.gpus.models[1]", "model name"),
    ("model-blank", {"count": 1, "models": ["  "]}, "spec.resources.gpus.models[0]", "model name"),
    ("model-too-long", {"count": 1, "models": ["h" * 121]}, "spec.resources.gpus.models[0]", "model name"),
    ("model-control", {"count": 1, "models": ["h1\n00"]}, "spec.resources.gpus.models[0]", "model name"),
    ("model-twice", {"count": 1, "models": ["h100", "H100 "]}, "spec.resources.gpus.models[1]", "twice"),
    ("huge-count", {"count": 10**4000, "models": ["h100"]}, "spec.resources.gpus", "more than 64"),
]


@pytest.mark.parametrize("value, path, message", [b[1:] for b in BAD_GPUS], ids=[b[0] for b in BAD_GPUS])
def test_bad_gpu_requests_are_refused_at_their_path(value, path, message):
    errors = refusals(spec_with(**{GPUS: value}))
    assert [p for p, _ in errors] == [path]
    assert message in errors[0][1]
    assert len(errors[0][1]) < 300  # nothing huge is echoed back


def test_every_bad_model_of_a_preference_is_named_at_once():
    errors = refusals(spec_with(**{GPUS: {"count": 1, "models": [1, "h100", "", "h100"]}}))
    assert [p for p, _ in errors] == [
        "spec.resources.gpus.models[0]",
        "spec.resources.gpus.models[2]",
        "spec.resources.gpus.models[3]",
    ]


def test_a_batch_spec_names_its_index_in_a_preference():
    errors = refusals(spec_with(**{GPUS: {"count": 1, "models": ["h100", 3]}}), "jobs[4]")
    assert [p for p, _ in errors] == ["jobs[4].spec.resources.gpus.models[1]"]


# --- preemption -------------------------------------------------------------------------------


def test_a_job_is_preemptible_with_the_default_signal_and_the_queues_grace_unless_it_says():
    spec = parse_job_spec(spec_with())
    assert (spec.preemptible, spec.preemption_signal, spec.preemption_grace_s) == (True, "TERM", None)


PREEMPTION_FORMS = [
    ("not-preemptible", {"spec__preemptible": False}, (False, "TERM", None)),
    ("preemptible-null", {"spec__preemptible": None}, (True, "TERM", None)),
    ("signal-short", {"spec__preemption": {"signal": "USR1"}}, (True, "USR1", None)),
    ("signal-sig-prefix", {"spec__preemption": {"signal": "SIGUSR2"}}, (True, "USR2", None)),
    ("signal-lowercase", {"spec__preemption": {"signal": " sigint "}}, (True, "INT", None)),
    ("signal-hup", {"spec__preemption": {"signal": "HUP"}}, (True, "HUP", None)),
    ("signal-quit", {"spec__preemption": {"signal": "QUIT"}}, (True, "QUIT", None)),
    ("grace-seconds", {"spec__preemption": {"grace": "45s"}}, (True, "TERM", 45)),
    ("grace-slurm", {"spec__preemption": {"grace": "02:00"}}, (True, "TERM", 120)),
    ("grace-iso", {"spec__preemption": {"grace": "PT1M30S"}}, (True, "TERM", 90)),
    ("grace-bare-minutes", {"spec__preemption": {"grace": 5}}, (True, "TERM", 300)),
    ("grace-zero", {"spec__preemption": {"grace": "0s"}}, (True, "TERM", 0)),
    ("grace-an-hour", {"spec__preemption": {"grace": "1h"}}, (True, "TERM", 3600)),
    ("empty-block", {"spec__preemption": {}}, (True, "TERM", None)),
    (
        "both",
        {"spec__preemptible": True, "spec__preemption": {"signal": "SIGUSR1", "grace": "2m"}},
        (True, "USR1", 120),
    ),
]


@pytest.mark.parametrize(
    "changes, expected", [f[1:] for f in PREEMPTION_FORMS], ids=[f[0] for f in PREEMPTION_FORMS]
)
def test_preemption_forms(changes, expected):
    spec = parse_job_spec(spec_with(**changes))
    assert (spec.preemptible, spec.preemption_signal, spec.preemption_grace_s) == expected


BAD_PREEMPTION = [
    ("preemptible-text", {"spec__preemptible": "no"}, "spec.preemptible"),
    ("preemptible-number", {"spec__preemptible": 0}, "spec.preemptible"),
    ("block-text", {"spec__preemption": "USR1"}, "spec.preemption"),
    ("block-list", {"spec__preemption": ["USR1"]}, "spec.preemption"),
    ("unknown-key", {"spec__preemption": {"signal": "USR1", "timeout": "1m"}}, "spec.preemption.timeout"),
    ("signal-kill", {"spec__preemption": {"signal": "KILL"}}, "spec.preemption.signal"),
    ("signal-stop", {"spec__preemption": {"signal": "SIGSTOP"}}, "spec.preemption.signal"),
    ("signal-number", {"spec__preemption": {"signal": 10}}, "spec.preemption.signal"),
    ("signal-empty", {"spec__preemption": {"signal": ""}}, "spec.preemption.signal"),
    ("signal-doubled-prefix", {"spec__preemption": {"signal": "SIGSIGTERM"}}, "spec.preemption.signal"),
    ("signal-long", {"spec__preemption": {"signal": "USR" * 10_000}}, "spec.preemption.signal"),
    ("grace-words", {"spec__preemption": {"grace": "a while"}}, "spec.preemption.grace"),
    ("grace-negative", {"spec__preemption": {"grace": -1}}, "spec.preemption.grace"),
    ("grace-over-an-hour", {"spec__preemption": {"grace": "61m"}}, "spec.preemption.grace"),
    ("grace-huge", {"spec__preemption": {"grace": 10**4000}}, "spec.preemption.grace"),
    ("grace-long-digits", {"spec__preemption": {"grace": "9" * 5000 + "s"}}, "spec.preemption.grace"),
    ("grace-boolean", {"spec__preemption": {"grace": True}}, "spec.preemption.grace"),
    ("grace-non-ascii", {"spec__preemption": {"grace": "٣٠s"}}, "spec.preemption.grace"),
]


@pytest.mark.parametrize("changes, path", [b[1:] for b in BAD_PREEMPTION], ids=[b[0] for b in BAD_PREEMPTION])
def test_bad_preemption_settings_are_refused_at_their_path(changes, path):
    errors = refusals(spec_with(**changes))
    assert [p for p, _ in errors] == [path]
    assert all(len(message) < 300 for _, message in errors)


def test_a_bare_grace_number_is_minutes_and_the_refusal_says_so():
    errors = refusals(spec_with(spec__preemption={"grace": 90}))
    assert errors[0][0] == "spec.preemption.grace" and "a bare number is minutes" in errors[0][1]


def test_every_preemption_problem_is_reported_at_once():
    errors = refusals(
        spec_with(spec__preemptible="yes", spec__preemption={"signal": "KILL", "grace": "2h", "x": 1})
    )
    assert sorted(p for p, _ in errors) == [
        "spec.preemptible",
        "spec.preemption.grace",
        "spec.preemption.signal",
        "spec.preemption.x",
    ]


@pytest.mark.parametrize("signal", ["TERM", "INT", "HUP", "USR1", "USR2", "QUIT"])
def test_every_signal_the_spec_accepts_is_one_a_preemption_sends(signal):
    """The normalised spec's ``preemption`` is what ``stop_terms`` reads: a signal it accepts
    must never fall back to TERM there."""
    spec = parse_job_spec(spec_with(spec__preemption={"signal": f"SIG{signal}", "grace": "10s"}))
    stored = {"preemption": {"signal": spec.preemption_signal, "graceSeconds": spec.preemption_grace_s}}
    assert stop_terms(stored, 30) == (signal, 10)
