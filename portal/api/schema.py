"""The job spec as an OpenAPI schema, for the generated API document and its clients.

The authority is ``scheduling.spec``; this schema describes the same shape so that tools (and
schemathesis, in the tests) can build valid requests."""

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

JOB_SPEC_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"type": "string", "enum": ["orrery/v1"]},
        "kind": {"type": "string", "enum": ["Job"]},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
                "project": {"type": "string", "description": "Defaults to your only project."},
                "labels": _STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "queue": {"type": "string", "default": "default"},
                "priority": {
                    "description": "Above the queue's maxMemberPriority only for managers and operators.",
                    "oneOf": [
                        {"type": "string", "enum": ["low", "normal", "high"]},
                        {"type": "integer", "minimum": -1000, "maximum": 1000},
                    ],
                },
                "resources": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "nodes": {"type": "integer", "minimum": 1, "maximum": 4096},
                        "gpus": {
                            "oneOf": [
                                {
                                    "type": "string",
                                    "description": "MODEL:COUNT (h100:8), MODEL (one), or COUNT / "
                                    "gpu:COUNT for any model",
                                },
                                {"type": "integer", "minimum": 0, "maximum": 64, "description": "any model"},
                                {
                                    "type": "object",
                                    "required": ["model"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "model": {"type": "string"},
                                        "count": {"type": "integer", "minimum": 0, "maximum": 64},
                                    },
                                },
                                {
                                    "type": "object",
                                    "required": ["count"],
                                    "additionalProperties": False,
                                    "description": "any model; of models (best first) when given",
                                    "properties": {
                                        "count": {"type": "integer", "minimum": 0, "maximum": 64},
                                        "models": {
                                            "type": "array",
                                            "items": {"type": "string"},
                                            "maxItems": 16,
                                            "uniqueItems": True,
                                        },
                                    },
                                },
                            ]
                        },
                        "cpus": {"oneOf": [{"type": "number", "minimum": 0}, {"type": "string"}]},
                        "memory": {
                            "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string"}],
                            "description": "256Gi, 512M…; a bare number is MiB",
                        },
                    },
                },
                "timeLimit": {
                    "oneOf": [{"type": "string"}, {"type": "integer", "minimum": 1}],
                    "description": "2h, 1-00:00:00, PT2H; a bare number is minutes",
                },
                "run": {"type": "string"},
                "setup": {"type": "string"},
                "image": {"type": "string"},
                "env": {
                    "type": "object",
                    "additionalProperties": {
                        "oneOf": [
                            {"type": "string"},
                            {
                                "type": "object",
                                "required": ["value"],
                                "additionalProperties": False,
                                "properties": {"value": {"type": "string"}, "secret": {"type": "boolean"}},
                            },
                        ]
                    },
                    "description": "NAME: value, or NAME: {value, secret: true} for a secret value",
                },
                "secretEnv": {
                    **_STRING_MAP,
                    "description": "Values only the running job sees: sealed at rest, never shown back.",
                },
                "workdir": {"type": "string"},
                "placement": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "clusters": {"type": "array", "items": {"type": "string"}},
                        "nodeSelector": _STRING_MAP,
                    },
                },
                "retries": {"type": "integer", "minimum": 0, "maximum": 100},
                "failover": {"type": "string", "enum": ["requeue", "hold", "fail"]},
                "array": {
                    "description": "An array (Slurm's --array): 0-99, 0-99:2 or 1,3,5, with %N to run at "
                    "most N tasks at once (0-99%10); or {indices, throttle}.",
                    "oneOf": [
                        {"type": "string"},
                        {"type": "integer", "minimum": 0, "maximum": 4_000_000},
                        {
                            "type": "object",
                            "required": ["indices"],
                            "additionalProperties": False,
                            "properties": {
                                "indices": {"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 0}]},
                                "throttle": {"type": "integer", "minimum": 0, "maximum": 10_000},
                            },
                        },
                    ],
                },
                "preemptible": {"type": "boolean", "default": True},
                "preemption": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "How a preempted job is told before it is killed.",
                    "properties": {
                        "signal": {
                            "type": "string",
                            "enum": ["TERM", "INT", "HUP", "USR1", "USR2", "QUIT"],
                            "description": "also SIGTERM, SIGUSR1…; default TERM",
                        },
                        "grace": {
                            "oneOf": [{"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 60}],
                            "description": "30s, 2m (a bare number is minutes); at most the queue's "
                            "preemptionGraceSeconds",
                        },
                    },
                },
                "dependency": {
                    "oneOf": [
                        {"type": "string", "maxLength": 20000},
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                **{
                                    kind: {"type": "array", "items": {"type": ["integer", "string"]}}
                                    for kind in ("afterok", "afterany", "afternotok")
                                },
                                "singleton": {"type": "boolean"},
                            },
                        },
                    ],
                    "description": "afterok:74:75_3,afterany:80,singleton (Slurm's), or "
                    "{afterok: [74, '75_3'], afterany: [80], singleton: true}; all must be met",
                },
                "sim": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "duration": {"type": "string"},
                        "exitCode": {"type": "integer", "minimum": 0, "maximum": 255},
                    },
                },
            },
        },
    },
}

JOB_BATCH_SCHEMA = {
    "type": "object",
    "required": ["jobs"],
    "additionalProperties": False,
    "properties": {"jobs": {"type": "array", "items": JOB_SPEC_SCHEMA, "minItems": 1, "maxItems": 1000}},
}

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "detail": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}

JOB_UPDATE_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": False,
    "description": "What to change on a waiting job (PENDING or HELD); at least one field.",
    "properties": {
        "timeLimit": {
            "description": "A duration (2h, 90m, 1-00:00:00; a bare number is minutes). Members may "
            "only lower it; managers and operators may raise it within the queue's maximum.",
            "oneOf": [{"type": "string"}, {"type": "integer", "minimum": 1}],
        },
        "priority": {
            "description": "Within the queue's maxMemberPriority for members.",
            "oneOf": [
                {"type": "string", "enum": ["low", "normal", "high"]},
                {"type": "integer", "minimum": -1000, "maximum": 1000},
            ],
        },
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
        "hold": {"type": "boolean", "description": "true: hold; false: release."},
        "throttle": {
            "type": "integer",
            "minimum": 0,
            "maximum": 10_000,
            "description": "An array's: at most N members run at once (0: no limit); set on every member.",
        },
        "version": {
            "type": "integer",
            "minimum": 0,
            "description": "The job's version as last read: the update is refused (409) if it changed.",
        },
    },
}
