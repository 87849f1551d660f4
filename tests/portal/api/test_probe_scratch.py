import base64, json
import pytest
from tests.portal.api.conftest import job_spec

pytestmark = pytest.mark.django_db

def show(r):
    print(r.status_code, r.content[:400])

@pytest.mark.parametrize("kind", ["cpus_inf_str", "cpus_1e999", "mem_digits", "gpu_nul", "yaml_date", "yaml_bigint", "tail_sup", "cursor", "filter_nul", "name_nl", "huge_env", "array_long", "node_nul", "cluster_nul", "bigpk", "rot13", "after_overflow", "list"])
def test_probe(api, alice, queue, fleet, kind):
    c = api(alice)
    if kind == "cpus_inf_str":
        r = c.post("/api/v1/jobs", job_spec(spec__resources__cpus="inf"), format="json")
    elif kind == "cpus_1e999":
        body = json.dumps(job_spec()).replace('"cpus": 32', '"cpus": 1e999')
        r = c.post("/api/v1/jobs", body, content_type="application/json")
    elif kind == "mem_digits":
        r = c.post("/api/v1/jobs", job_spec(spec__resources__memory="9"*400), format="json")
    elif kind == "gpu_nul":
        r = c.post("/api/v1/jobs", job_spec(spec__resources__gpus="h1\x00:8"), format="json")
    elif kind == "yaml_date":
        r = c.post("/api/v1/jobs", "apiVersion: orrery/v1\nmetadata: {name: 2026-02-30}\n", content_type="application/yaml")
    elif kind == "yaml_bigint":
        r = c.post("/api/v1/jobs", "apiVersion: orrery/v1\nmetadata: {name: " + "1"*5000 + "}\n", content_type="application/yaml")
    elif kind == "tail_sup":
        from tests.factories import make_job
        j = make_job(alice, queue)
        r = c.get(f"/api/v1/jobs/{j.pk}/logs", {"tail": "²"})
    elif kind == "cursor":
        r = c.get("/api/v1/jobs", {"cursor": base64.b64encode(b"p=abc").decode()})
    elif kind == "filter_nul":
        r = c.get("/api/v1/jobs", {"project": "a\x00b"})
    elif kind == "name_nl":
        r = c.post("/api/v1/jobs", job_spec(metadata__name="t\n"), format="json")
    elif kind == "huge_env":
        env = {f"V{i}": "x" * 4000 for i in range(2400)}
        r = c.post("/api/v1/jobs", job_spec(spec__env=env), format="json")
    elif kind == "array_long":
        r = c.post("/api/v1/jobs/batch", {"jobs": [job_spec(metadata__name="n" * 128, spec__array="0-1")]}, format="json")
    elif kind == "node_nul":
        r = c.get("/api/v1/nodes", {"gpuModel": "a\x00"})
    elif kind == "cluster_nul":
        r = c.get("/api/v1/clusters/a%00b")
    elif kind == "bigpk":
        r = c.get("/api/v1/jobs/99999999999999999999999999")
    elif kind == "rot13":
        r = c.post("/api/v1/jobs", "apiVersion: x", content_type="application/yaml; charset=rot13")
    elif kind == "after_overflow":
        r = c.get("/api/v1/jobs", {"submittedAfter": "0001-01-01T00:00:00+05:00"})
    elif kind == "list":
        r = c.post("/api/v1/jobs", [job_spec()], format="json")
    show(r)
    assert False
