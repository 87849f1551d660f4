"""Orrery's settings, read from the environment once, here.

Two shapes of deployment share this file:

* the embedded default (no variables set): SQLite under ``var/``, an in-memory channel layer,
  in-process heartbeat buffers, scheduler and aggregator on an in-process timer;
* production (``ORRERY_ENVIRONMENT=production``): PostgreSQL from ``DATABASE_URL``, Redis from
  ``REDIS_URL``, HTTPS hardening, and a secret key that must come from ``ORRERY_SECRET_KEY``.
  Production refuses to start with debug pages on, a weak or placeholder secret key, or ``*`` in
  the allowed hosts (``portal/deployment.py``); ``manage.py check --deploy`` reports the same
  problems as errors in any environment (``portal/checks.py``).
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from portal.deployment import production_problems
from scheduling.refs import PATTERN as JOB_REF_PATTERN

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no).")


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


ENVIRONMENT = os.environ.get("ORRERY_ENVIRONMENT", "development")
if ENVIRONMENT not in {"development", "production"}:
    raise ImproperlyConfigured(f"ORRERY_ENVIRONMENT={ENVIRONMENT!r}: use 'development' or 'production'.")
PRODUCTION = ENVIRONMENT == "production"

DATA_DIR = Path(os.environ.get("ORRERY_DATA_DIR", BASE_DIR / "var"))
DATA_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("ORRERY_DEBUG", False)


def _secret_key() -> str:
    key = os.environ.get("ORRERY_SECRET_KEY")
    if key:
        return key
    if PRODUCTION:
        raise ImproperlyConfigured("ORRERY_SECRET_KEY must be set when ORRERY_ENVIRONMENT=production.")
    # Development: one random key per data folder, kept so sessions survive a restart.
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()


def _secrets_keys() -> list[str]:
    """Keys that seal cluster secrets at rest (``foundation.sealing``), newest first."""
    keys = env_list("ORRERY_SECRETS_KEYS", "")
    if keys:
        return keys
    if PRODUCTION:
        raise ImproperlyConfigured(
            "ORRERY_SECRETS_KEYS must be set when ORRERY_ENVIRONMENT=production "
            "(python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')."
        )
    path = DATA_DIR / "secrets_key"  # development: one key per data folder, kept
    if not path.exists():
        from cryptography.fernet import Fernet

        path.write_text(Fernet.generate_key().decode())
        path.chmod(0o600)
    return [path.read_text().strip()]


ORRERY_SECRETS_KEYS = _secrets_keys()
ALLOWED_HOSTS = env_list("ORRERY_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("ORRERY_CSRF_TRUSTED_ORIGINS", "")
if PRODUCTION and (
    problems := production_problems(debug=DEBUG, secret_key=SECRET_KEY, allowed_hosts=ALLOWED_HOSTS)
):
    raise ImproperlyConfigured("Refusing to start in production: " + "; ".join(problems) + ".")

INSTALLED_APPS = [
    "daphne",
    "portal.apps.OrreryAdminConfig",  # django.contrib.admin with Orrery's landing and scheduler pages
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_prometheus",
    "axes",
    "foundation",
    "clusters",
    "scheduling",
    "portal",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "portal.middleware.DatabaseUnavailable",  # outermost but metrics: a 503 for any layer's DB error
    "portal.middleware.ContentSecurityPolicy",
    "portal.middleware.RejectNulBytes",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.middleware.AuditSource",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # turns a lockout into its page; after auth, as axes asks
    "portal.api.fairness.ReleaseTenantSlots",  # gives back the API's per-tenant slots (below)
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database -------------------------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL", f"sqlite:///{DATA_DIR / 'orrery.sqlite3'}")
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60, conn_health_checks=True)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        # WAL lets the portal read while the scheduler writes; IMMEDIATE takes the write lock at
        # BEGIN so two writers queue on busy_timeout instead of failing on a lock upgrade.
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=10000;",
        "transaction_mode": "IMMEDIATE",
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A dead peer is noticed in about 25 s rather than the kernel's two hours: TCP keepalives on
    # both ends (the server's through "options"), so a vanished worker's session ends and a
    # vanished server fails the worker's call; and a connect that hangs gives up after 5 s.
    DATABASES["default"]["OPTIONS"] = {
        "connect_timeout": 5,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "options": "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
        **DATABASES["default"].get("OPTIONS", {}),  # what the URL's query string says wins
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- redis, cache, channels, celery -----------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    # Redis is a cache: while it is away reads miss and writes are dropped (foundation/cache.py)
    CACHES = {"default": {"BACKEND": "foundation.cache.ForgivingRedisCache", "LOCATION": REDIS_URL}}
    # The layer's blocking receive waits 5 s on Redis: a read time-out must be longer, or an idle
    # socket's receive fails and the socket closes (redis-py 8 reads with a 5 s default).
    # redis-py hands out a pooled connection from before a Redis restart unchecked (its check
    # for a closed connection is skipped while maintenance notifications are "auto"), so its
    # first command fails. One immediate retry on a fresh connection: a receive does not count
    # a fault for it, and the sockets that reconnected after the restart are not closed again.
    # (The asyncio Retry: the layer's client awaits it.)
    _CHANNEL_REDIS = {
        "socket_timeout": 15.0,
        "socket_connect_timeout": 3.0,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "foundation.live.RedisChannelLayer",
            # All sockets of one Daphne process share one Redis list ("specific.…!"); at the
            # layer's default of 100 unread messages a process 100 events behind silently loses
            # the newest for every socket on it. A longer list turns that loss into latency,
            # which the consumers' coalescing absorbs (messages still expire after 60 s).
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, **_CHANNEL_REDIS}],
                "channel_capacity": {"specific.*": 10_000},
            },
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery: workers by role, beat behind a lease. Every task is a pass that beat sends again or a
# doorbell the next pass covers, so none is acknowledged late: a message in flight when a worker
# or Redis dies is simply dropped (nothing is left unacknowledged to restore on reconnect), and
# each periodic entry expires before its next run, so a backlog from an outage is discarded
# instead of worked through.
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
# A worker never gives up on the broker: it retries without limit, at most
# ORRERY_CELERY_RECONNECT_MAX_S apart (portal.celery.Consumer), so it is back within seconds of
# Redis, however long Redis was away.
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_CONSUMER = "portal.celery:Consumer"
ORRERY_CELERY_RECONNECT_MAX_S = float(os.environ.get("ORRERY_CELERY_RECONNECT_MAX_S", 1.0))
# The energy meter's period (scheduling/services/energy.py; docs/operations.md, "Energy
# metering"): each reading adds what an active attempt's GPUs drew since the last one, at most
# three periods' worth.
ORRERY_ENERGY_METER_S = float(os.environ.get("ORRERY_ENERGY_METER_S", 60))
if not ORRERY_ENERGY_METER_S > 0:
    raise ImproperlyConfigured(
        f"ORRERY_ENERGY_METER_S={ORRERY_ENERGY_METER_S}: use a number of seconds above 0."
    )
# Periodic work. Each entry expires before its next run, so a worker that falls behind never
# works through a backlog of stale passes.
# Telemetry reaches the Node and GPU rows (and their averages move) this often.
ORRERY_TELEMETRY_SYNC_S = float(os.environ.get("ORRERY_TELEMETRY_SYNC_S", 60))
_PERIODIC = {
    "flush-heartbeats": ("clusters.tasks.flush_heartbeats_task", 2.0),
    "node-lifecycle": ("clusters.tasks.node_lifecycle_task", 5.0),
    "sync-telemetry": (
        "clusters.tasks.sync_telemetry_task",
        float(os.environ.get("ORRERY_TELEMETRY_SYNC_S", 60)),
    ),
    "prune-metrics": ("clusters.tasks.prune_metrics_task", 600.0),
    "meter-energy": ("scheduling.tasks.meter_energy_task", ORRERY_ENERGY_METER_S),
    "settle-draining-nodes": ("clusters.tasks.settle_draining_nodes_task", 5.0),
    "scheduling-cycle": ("scheduling.tasks.scheduling_cycle_task", 1.0),
    # every kind: deliver the outbox; sync polled clusters at their adapter's own interval
    "dispatch-outbox": ("scheduling.tasks.dispatch_outbox_task", 1.0),
    "sync-clusters": ("scheduling.tasks.sync_clusters_task", 1.0),
    "sweep-lost-nodes": ("scheduling.tasks.sweep_lost_nodes_task", 10.0),
    # held BudgetExhausted jobs that fit now (a window began, ended jobs gave back reservations)
    "release-budget-holds": ("scheduling.tasks.release_budget_holds_task", 60.0),
    # every 2 s; each kind keeps its own pace (adapter.inventory_every_s)
    "cluster-inventory": ("clusters.tasks.take_inventories_task", 2.0),
    "deliver-notifications": ("scheduling.tasks.deliver_notifications_task", 5.0),
    # idle nodes of clusters whose power-saving switch is on (clusters/services/power.py)
    "power-saving": ("clusters.tasks.power_saving_task", 300.0),
}
# Each task's role; role R's queue is "<ORRERY_CELERY_QUEUE>.R", so production runs workers per
# role (`celery worker -Q orrery.scheduling`) and a flood of one kind never waits in front of
# another. The node lifecycle shares ingest's queue: when ingest is behind, silence is not judged
# from last-seen rows the backlog has not written yet.
ORRERY_CELERY_QUEUE = os.environ.get("ORRERY_CELERY_QUEUE", "orrery")
ORRERY_CELERY_ROLES = ("ingest", "aggregation", "scheduling", "dispatch", "sync", "notifications")
_TASK_ROLES = {
    "clusters.tasks.flush_heartbeats_task": "ingest",
    "clusters.tasks.take_inventories_task": "ingest",
    "clusters.tasks.node_lifecycle_task": "ingest",
    "clusters.tasks.sync_telemetry_task": "aggregation",
    "clusters.tasks.prune_metrics_task": "aggregation",
    "scheduling.tasks.meter_energy_task": "aggregation",
    "scheduling.tasks.scheduling_cycle_task": "scheduling",
    "scheduling.tasks.sweep_lost_nodes_task": "scheduling",
    "scheduling.tasks.release_budget_holds_task": "scheduling",
    "clusters.tasks.settle_draining_nodes_task": "scheduling",
    "scheduling.tasks.dispatch_outbox_task": "dispatch",
    # reading clusters back never waits behind a long delivery, nor a delivery behind a read
    "scheduling.tasks.sync_clusters_task": "sync",
    "scheduling.tasks.sync_cluster_task": "sync",
    "scheduling.tasks.deliver_notifications_task": "notifications",
    "clusters.tasks.power_saving_task": "dispatch",  # it calls the clusters' APIs, as dispatch does
}
CELERY_TASK_ROUTES = {task: {"queue": f"{ORRERY_CELERY_QUEUE}.{role}"} for task, role in _TASK_ROLES.items()}
CELERY_TASK_DEFAULT_QUEUE = f"{ORRERY_CELERY_QUEUE}.notifications"  # a task with no route of its own
# A worker started without -Q serves every role (a small site's two workers); -Q picks roles.
CELERY_TASK_QUEUES = [
    Queue(name, Exchange(name), routing_key=name)  # as Celery makes a queue it was not told of
    for name in (f"{ORRERY_CELERY_QUEUE}.{role}" for role in ORRERY_CELERY_ROLES)
]
CELERY_BEAT_SCHEDULE = {
    name: {"task": task, "schedule": every, "options": {"expires": every}}
    for name, (task, every) in _PERIODIC.items()
}
# Beat runs in two (or more) copies; only the holder of a lease in PostgreSQL sends, and a
# standby takes the lease within ORRERY_BEAT_LEASE_S + 1 s of the holder's death
# (foundation.beat). ORRERY_BEAT_METRICS_PORT, when set, serves the beat's Prometheus metrics.
CELERY_BEAT_SCHEDULER = "foundation.beat:LeaseScheduler"
ORRERY_BEAT_LEASE_S = float(os.environ.get("ORRERY_BEAT_LEASE_S", 10.0))
ORRERY_BEAT_METRICS_PORT = int(os.environ.get("ORRERY_BEAT_METRICS_PORT", 0)) or None

# --- auth and security ------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Axes' backend comes first: it refuses a locked-out (user name, address) pair before any
# password is checked, so the right password does not get through a lockout either.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# Login throttling (django-axes, portal/lockout.py). Failures are counted per (user name, client
# address) pair, in the database so that every process sees them. Not per user name alone: then
# anyone could lock any user out from everywhere by typing wrong passwords; not per address
# alone: then one attacker behind a shared NAT locks out everyone behind it.
AXES_HANDLER = "axes.handlers.database.AxesDatabaseHandler"
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_FAILURE_LIMIT = int(os.environ.get("ORRERY_LOGIN_FAILURE_LIMIT", 5))
ORRERY_LOGIN_LOCKOUT_S = int(os.environ.get("ORRERY_LOGIN_LOCKOUT_S", 900))
AXES_COOLOFF_TIME = timedelta(seconds=ORRERY_LOGIN_LOCKOUT_S)
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "portal.lockout.client_address"
AXES_LOCKOUT_CALLABLE = "portal.lockout.lockout_response"
AXES_VERBOSE = False

# Debug pages and error reports redact passwords inside URLs in any setting (portal/error_reports.py).
DEFAULT_EXCEPTION_REPORTER_FILTER = "portal.error_reports.RedactingExceptionReporterFilter"

# /metrics answers this bearer token (Prometheus' `authorization: credentials`) or a staff session.
ORRERY_METRICS_TOKEN = os.environ.get("ORRERY_METRICS_TOKEN", "")

# Headers set by a reverse proxy (X-Forwarded-Proto, X-Forwarded-For) are believed only when the
# operator says one is in front and strips what clients send; otherwise any client could claim
# HTTPS or another address.
ORRERY_BEHIND_PROXY = env_bool("ORRERY_BEHIND_PROXY", False)
if ORRERY_BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

HTTPS = env_bool("ORRERY_HTTPS", PRODUCTION)
if HTTPS:
    SECURE_SSL_REDIRECT = env_bool("ORRERY_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("ORRERY_HSTS_SECONDS", 31536000))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env_bool("ORRERY_HSTS_PRELOAD", False)
    SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# --- i18n, static -----------------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
# Outside production the files are served from the source tree, with no collectstatic step.
WHITENOISE_USE_FINDERS = not PRODUCTION
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "portal.api.permissions.TokenScope",
        "portal.api.fairness.TenantConcurrency",  # last: only requests let in take a slot
    ],
    "DEFAULT_PARSER_CLASSES": [
        "portal.api.parsers.StrictJsonParser",
        "portal.api.parsers.YamlParser",
        "portal.api.parsers.XYamlParser",
        "portal.api.parsers.TextYamlParser",
    ],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_THROTTLE_RATES": {
        "submit": os.environ.get("ORRERY_THROTTLE_SUBMIT", "1200/min"),
        "read": os.environ.get("ORRERY_THROTTLE_READ", "6000/min"),
        "anon": os.environ.get("ORRERY_THROTTLE_ANON", "120/min"),
    },
    "DEFAULT_THROTTLE_CLASSES": ["portal.api.throttles.AnonymousThrottle"],
    "EXCEPTION_HANDLER": "portal.api.errors.handle_exception",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Orrery API",
    "DESCRIPTION": "One job API for every GPU cluster. Authenticate with `Authorization: Bearer <token>`.",
    "VERSION": "v1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},  # no badge from validator.swagger.io
    "COMPONENT_SPLIT_REQUEST": True,
    "PATH_CONVERTER_OVERRIDES": {"jobref": {"type": "string", "pattern": "^" + JOB_REF_PATTERN + "$"}},
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "scheduling.choices.JobState",
        "NodeStateEnum": "clusters.choices.NodeState",
        "ClusterStateEnum": "clusters.choices.ClusterState",
        "TokenScopeEnum": "portal.choices.Scope",
    },
}
# Job specs are small; a batch of 1,000 fits in a few MiB. Larger bodies are refused (413).
DATA_UPLOAD_MAX_MEMORY_SIZE = 8 * 2**20

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("ORRERY_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

# --- Orrery -----------------------------------------------------------------------------------
# Per-tenant fairness on the API (portal/api/fairness.py): at most this many requests of one user
# in flight at once across every web process (per process while Redis does not answer); one more
# is a 429 with Retry-After. Keep it well under the API tier's threads (16 in docs/operations.md)
# so one tenant never holds them all; 0 turns the limit off. A killed web worker's slots come
# back after the lease, which must outlast any request (gunicorn's timeout).
ORRERY_API_TENANT_CONCURRENCY = int(os.environ.get("ORRERY_API_TENANT_CONCURRENCY", 4))
ORRERY_API_TENANT_LEASE_S = float(os.environ.get("ORRERY_API_TENANT_LEASE_S", 60))

# Node lifecycle timers (seconds): not ready after NODE_GRACE of silence, down (failover) after
# NODE_FAILOVER_AFTER, ready again after NODE_RECOVERY of heartbeats on time.
NODE_GRACE = int(os.environ.get("ORRERY_NODE_GRACE", 40))
NODE_FAILOVER_AFTER = int(os.environ.get("ORRERY_NODE_FAILOVER_AFTER", 300))
NODE_RECOVERY = int(os.environ.get("ORRERY_NODE_RECOVERY", 30))
# The same periodic work on in-process timers in the embedded default (no broker, no beat).
ORRERY_EMBEDDED_TASKS = [(task, every) for task, every in _PERIODIC.values()]
# Flow control: a project's waiting (PENDING + HELD) jobs are capped; submissions past it get 429.
ORRERY_MAX_WAITING_JOBS_PER_PROJECT = int(os.environ.get("ORRERY_MAX_WAITING_JOBS_PER_PROJECT", 100_000))
# …and each user's within a project, so one member's backlog never locks the others out.
ORRERY_MAX_WAITING_JOBS_PER_USER = int(os.environ.get("ORRERY_MAX_WAITING_JOBS_PER_USER", 20_000))
ORRERY_HEARTBEAT_INTERVAL = int(os.environ.get("ORRERY_HEARTBEAT_INTERVAL", 10))
# A join token expires this long after it is made unless its maker says otherwise.
ORRERY_JOIN_TOKEN_TTL_S = int(os.environ.get("ORRERY_JOIN_TOKEN_TTL_S", 3600))
# Every personal API token expires: by default, and at most, this many days after it is issued.
ORRERY_TOKEN_MAX_DAYS = int(os.environ.get("ORRERY_TOKEN_MAX_DAYS", 90))
if ORRERY_TOKEN_MAX_DAYS < 1:
    raise ImproperlyConfigured(
        f"ORRERY_TOKEN_MAX_DAYS={ORRERY_TOKEN_MAX_DAYS}: use a number of days, 1 or more."
    )
ORRERY_REDIS_PREFIX = os.environ.get("ORRERY_REDIS_PREFIX", "orrery:")
ORRERY_FAILOVER_PER_MINUTE = int(os.environ.get("ORRERY_FAILOVER_PER_MINUTE", 10))

# Notifications (scheduling/services/notification_delivery.py; docs/security.md, "Webhooks").
# Email goes through Django's mail framework (EMAIL_HOST, EMAIL_PORT…); links in messages start
# with ORRERY_PUBLIC_URL. A webhook may not target a loopback, private, link-local or reserved
# address unless ORRERY_WEBHOOK_ALLOW_PRIVATE (a site whose receivers live on its own network).
DEFAULT_FROM_EMAIL = os.environ.get("ORRERY_FROM_EMAIL", "orrery@localhost")
EMAIL_HOST = os.environ.get("ORRERY_EMAIL_HOST", "localhost")
EMAIL_PORT = int(os.environ.get("ORRERY_EMAIL_PORT", 25))
EMAIL_TIMEOUT = 10
ORRERY_PUBLIC_URL = os.environ.get("ORRERY_PUBLIC_URL", "http://localhost:8000")
ORRERY_WEBHOOK_ALLOW_PRIVATE = env_bool("ORRERY_WEBHOOK_ALLOW_PRIVATE", False)
ORRERY_WEBHOOK_TIMEOUT_S = float(os.environ.get("ORRERY_WEBHOOK_TIMEOUT_S", 5))
ORRERY_NOTIFY_MAX_TRIES = int(os.environ.get("ORRERY_NOTIFY_MAX_TRIES", 8))

# Hearing, flapping and ingest flow control (clusters/services/hearing.py, lifecycle.py,
# clusters/ingest/flow.py; docs/architecture.md, "Heartbeats and node lifecycle").
# The lifecycle judges silence only while the control plane itself hears: its heartbeat flush
# succeeded within ORRERY_HEARING_GAP_S, and without a longer gap for at least NODE_GRACE.
# Keep ORRERY_HEARING_GAP_S + ORRERY_HEARTBEAT_INTERVAL below NODE_GRACE.
ORRERY_HEARING_GAP_S = float(os.environ.get("ORRERY_HEARING_GAP_S", 10))
# A node comes back only with its last heartbeat within NODE_RECOVERY_FRESH (two intervals and
# a flush period; never more than NODE_GRACE) and a run of NODE_RECOVERY without a longer gap,
# doubled for each time it went not ready in the last NODE_FLAP_WINDOW, up to NODE_RECOVERY_MAX.
NODE_RECOVERY_FRESH = float(
    os.environ.get(
        "ORRERY_NODE_RECOVERY_FRESH", 2 * ORRERY_HEARTBEAT_INTERVAL + _PERIODIC["flush-heartbeats"][1]
    )
)
NODE_FLAP_WINDOW = int(os.environ.get("ORRERY_NODE_FLAP_WINDOW", 900))
NODE_RECOVERY_MAX = int(os.environ.get("ORRERY_NODE_RECOVERY_MAX", 480))
# Telemetry a GPU or node reported longer ago than this is stale, and nothing trusts it:
# /metrics/gpus leaves the GPU out, power estimates stop believing the node's reading, the energy
# meter counts no power for it, load-aware placement treats the node as unknown and shared GPUs
# are placed by allocations alone. Telemetry reaches the rows every sync-telemetry period, so a
# live node's reading is up to one period and a heartbeat old.
ORRERY_TELEMETRY_STALE_S = float(
    os.environ.get("ORRERY_TELEMETRY_STALE_S", 3 * _PERIODIC["sync-telemetry"][1])
)
# Power saving (clusters/services/power.py; docs/operations.md, "Power saving"): a ready node
# with no work for ORRERY_POWER_IDLE_S is recommended for powering down, keeping at least
# ORRERY_POWER_KEEP_IDLE idle nodes ready per cluster and GPU model; a node with no fresh reading
# of its own draw is estimated at ORRERY_POWER_NODE_BASE_W plus 15 % of each GPU's TDP.
ORRERY_POWER_IDLE_S = int(os.environ.get("ORRERY_POWER_IDLE_S", 1800))
ORRERY_POWER_KEEP_IDLE = int(os.environ.get("ORRERY_POWER_KEEP_IDLE", 2))
ORRERY_POWER_NODE_BASE_W = float(os.environ.get("ORRERY_POWER_NODE_BASE_W", 250))
# Agent requests served at once per process past which ingest answers 429; the Retry-After it
# suggests is ORRERY_INGEST_RETRY_AFTER_S plus up to as much again of jitter (also for 503).
ORRERY_INGEST_MAX_IN_FLIGHT = int(os.environ.get("ORRERY_INGEST_MAX_IN_FLIGHT", 16))
ORRERY_INGEST_RETRY_AFTER_S = int(os.environ.get("ORRERY_INGEST_RETRY_AFTER_S", 5))

# Telemetry averages (clusters/services/aggregation.py, sync_telemetry): each GPU's utilisation,
# memory and temperature averages move by ORRERY_TELEMETRY_EMA_ALPHA of the way to each new
# reading. An average whose last reading is older than ORRERY_TELEMETRY_STALE_S (above) starts
# again from the new one.
ORRERY_TELEMETRY_EMA_ALPHA = float(os.environ.get("ORRERY_TELEMETRY_EMA_ALPHA", 0.3))
if not 0 < ORRERY_TELEMETRY_EMA_ALPHA <= 1:
    raise ImproperlyConfigured(
        f"ORRERY_TELEMETRY_EMA_ALPHA={ORRERY_TELEMETRY_EMA_ALPHA}: use a fraction above 0 and at most 1."
    )

# The scheduler (scheduling/engine/policies.py documents the profile).
# None: the default profile (scheduling.engine.policies.DEFAULT_PROFILE); or a dict of the same shape.
ORRERY_SCHEDULER_PROFILE = None
ORRERY_SCHEDULER_RESYNC_S = float(os.environ.get("ORRERY_SCHEDULER_RESYNC_S", 60))
# Telemetry the scheduler reads (load-aware placement, shared GPUs' memory in use): re-read every
# ORRERY_SCHEDULER_TELEMETRY_S; a reading older than ORRERY_TELEMETRY_STALE_S is not trusted.
ORRERY_SCHEDULER_TELEMETRY_S = float(os.environ.get("ORRERY_SCHEDULER_TELEMETRY_S", 30))
ORRERY_SCHEDULER_MAX_PLACEMENTS = int(os.environ.get("ORRERY_SCHEDULER_MAX_PLACEMENTS", 20_000))
ORRERY_SCHEDULER_EXPLAIN_BUDGET = int(os.environ.get("ORRERY_SCHEDULER_EXPLAIN_BUDGET", 5_000))
# Predicted start times written per cycle at most (only those that moved are written).
ORRERY_SCHEDULER_ESTIMATE_BUDGET = int(os.environ.get("ORRERY_SCHEDULER_ESTIMATE_BUDGET", 500))
# A cycle's stall bound (scheduling/engine/cycle/lock.py): each statement, lock wait and idle
# pause of a cycle is cut at this many seconds, and a holder of the scheduling lock whose
# transaction has run longer is terminated and replaced by the next cycle attempted elsewhere.
ORRERY_SCHEDULER_STALL_S = float(os.environ.get("ORRERY_SCHEDULER_STALL_S", 10))
# On PostgreSQL a cycle's commit runs on a second connection while the next cycle decides
# (scheduling/engine/cycle/__init__.py, CyclePipeline); false keeps one transaction per cycle.
ORRERY_SCHEDULER_PIPELINE = env_bool("ORRERY_SCHEDULER_PIPELINE", True)
# Simulated clusters: how long a job runs when its spec says nothing (spec.sim.duration).
ORRERY_SIM_DEFAULT_DURATION_S = int(os.environ.get("ORRERY_SIM_DEFAULT_DURATION_S", 120))

# Dispatch flow control: at most this many deliveries a second to one cluster (a token bucket
# that every worker shares, bursts of one second's worth), so a burst of placements never floods
# a slurmctld or a Kubernetes API server; what waits stays pending, in order, for the next
# sweep. 0: no limit. Per kind: "kind=rate,…"; simulated and native clusters call no remote API.
ORRERY_DISPATCH_PER_CLUSTER_PER_S = float(os.environ.get("ORRERY_DISPATCH_PER_CLUSTER_PER_S", 50))
ORRERY_DISPATCH_PER_S_BY_KIND = {
    kind: float(rate)
    for kind, _, rate in (
        item.partition("=") for item in env_list("ORRERY_DISPATCH_PER_S_BY_KIND", "simulated=0,native=0")
    )
}
# A polled cluster whose scheduler rang at a job's end in the last minute (Slurm's
# EpilogSlurmctld, scheduling/wakeup.py rings) has its ends read by ring; its whole sync, left
# to find starts, lost rings and orphans, runs this often instead of at its kind's own pace.
ORRERY_RUNG_SYNC_EVERY_S = float(os.environ.get("ORRERY_RUNG_SYNC_EVERY_S", 5))
# The ports a gang's head may listen on (MASTER_PORT, scheduling/dispatch/ports.py): where the
# attempts on a node share its network, each gang headed there gets the lowest one of
# [BASE, BASE + PORTS) that no other active attempt on that node holds.
ORRERY_MASTER_PORT_BASE = int(os.environ.get("ORRERY_MASTER_PORT_BASE", 29500))
ORRERY_MASTER_PORTS = int(os.environ.get("ORRERY_MASTER_PORTS", 1000))
