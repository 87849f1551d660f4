"""Live dashboards over websockets.

Each consumer authenticates with the session (``AuthMiddlewareStack``; the ASGI app also checks
the Origin against ``ALLOWED_HOSTS``), decides what the user may see, joins the channel-layer
groups of that, and then **coalesces**: events that arrive are folded into one pending delta
(job id → state, node id → state) and sent at most once per second. A subscriber therefore
never receives raw heartbeats or one message per event, however busy the fleet is. Every event
is checked against what this subscriber may see before it is folded in, so a user never hears
of another project's job. A client that reconnects resynchronises from REST (``portal/live.js``).

Access is decided at connect and again every 30 s, so a user removed from a project stops
hearing about it without reconnecting. Close codes: 4401 not signed in, 4404 no such job or
not yours (also when access is lost).
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from clusters.selectors import cluster_by_name
from portal.access import access_job, visible_projects

FLUSH_S = 1.0
RECHECK_S = 30.0


class LiveConsumer(AsyncJsonWebsocketConsumer):
    flush_s = FLUSH_S
    recheck_s = RECHECK_S  # access is decided again this often: a user removed from a project
    # stops hearing about it within this time, without reconnecting

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.user = user
        self.jobs: dict[int, str] = {}
        self.nodes: dict[int, str] = {}
        self.new_jobs = 0
        groups = await self.authorise()
        if groups is None:
            await self.close(code=4404)
            return
        self.live_groups = groups
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", "groups": len(groups)})
        self.flusher = asyncio.ensure_future(self._flush_forever())

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "flusher"):
            self.flusher.cancel()
        for group in getattr(self, "live_groups", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def authorise(self) -> list[str] | None:
        """The groups this user may hear; ``None`` refuses the connection."""
        raise NotImplementedError

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return True

    async def live_event(self, message: dict[str, Any]) -> None:
        event, data = message["event"], message["data"]
        if not self.allowed(event, data):
            return
        if event == "JobStateChanged":
            self.jobs[data["job_id"]] = data["to_state"]
        elif event in ("JobsChanged", "JobsScheduled", "JobsSubmitted"):
            state = {"JobsScheduled": "SCHEDULED", "JobsSubmitted": "PENDING"}.get(
                event, data.get("to_state")
            )
            for job_id in data["job_ids"]:
                self.jobs[job_id] = state
            if event == "JobsSubmitted":
                self.new_jobs += data["count"]
        elif event == "NodeStateChanged":
            self.nodes[data["node_id"]] = data["to_state"]
        elif event == "NodesStateChanged":
            for node_id in data["node_ids"]:
                self.nodes[node_id] = data["to_state"]

    async def _recheck(self) -> bool:
        """Decide access again; leave groups no longer allowed. False closes the socket."""
        groups = await self.authorise()
        if groups is None:
            await self.close(code=4404)
            return False
        for group in set(self.live_groups) - set(groups):
            await self.channel_layer.group_discard(group, self.channel_name)
        for group in set(groups) - set(self.live_groups):
            await self.channel_layer.group_add(group, self.channel_name)
        self.live_groups = groups
        return True

    async def _flush_forever(self) -> None:
        since_check = 0.0
        while True:
            await asyncio.sleep(self.flush_s)
            since_check += self.flush_s
            if since_check >= self.recheck_s:
                since_check = 0.0
                if not await self._recheck():
                    return
            if self.jobs or self.nodes or self.new_jobs:
                delta = {"type": "delta", "jobs": self.jobs, "nodes": self.nodes, "newJobs": self.new_jobs}
                self.jobs, self.nodes, self.new_jobs = {}, {}, 0
                await self.send_json(delta)


class JobsConsumer(LiveConsumer):
    """``/ws/jobs/``: every job of the projects the user belongs to (operators: all)."""

    async def authorise(self) -> list[str] | None:
        self.projects = set(await database_sync_to_async(_project_ids)(self.user))
        return [f"project.{p}" for p in sorted(self.projects)]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return data.get("project_id") in self.projects


class JobConsumer(LiveConsumer):
    """``/ws/jobs/<id>/``: one job, for those who may open its page."""

    async def authorise(self) -> list[str] | None:
        job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        project = await database_sync_to_async(_job_project)(self.user, job_id)
        if project is None:
            return None
        self.job_id, self.project = job_id, project
        return [f"job.{job_id}", f"project.{project}"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        if data.get("project_id") != self.project:
            return False
        return data.get("job_id") == self.job_id or self.job_id in (data.get("job_ids") or ())


class FleetConsumer(LiveConsumer):
    """``/ws/fleet/``: node state changes across the fleet (nodes are not project data)."""

    async def authorise(self) -> list[str] | None:
        return ["fleet"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return event in ("NodeStateChanged", "NodesStateChanged")


class ClusterConsumer(LiveConsumer):
    """``/ws/clusters/<name>/``: one cluster's node state changes."""

    async def authorise(self) -> list[str] | None:
        name = self.scope["url_route"]["kwargs"]["name"]
        cluster = await database_sync_to_async(cluster_by_name)(name)
        if cluster is None:
            return None
        self.cluster_id = cluster.pk
        return [f"cluster.{cluster.pk}"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return data.get("cluster_id") == self.cluster_id


def _project_ids(user: Any) -> list[int]:
    return list(visible_projects(user).values_list("pk", flat=True))


def _job_project(user: Any, job_id: int) -> int | None:
    from django.http import Http404

    try:
        return access_job(user, job_id).project_id
    except Http404:
        return None
