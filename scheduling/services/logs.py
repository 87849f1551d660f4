"""Job output, as clusters ship it: stored per attempt and node, in bytes, capped."""

from __future__ import annotations

from django.db import transaction

from clusters.adapters.base import LogChunk
from scheduling.models import JobAttempt, JobLog


def store_log(chunk: LogChunk) -> bool:
    """Append a chunk of output. ``offset`` is where the chunk starts in the node's stream, in
    bytes, so a chunk sent again (the agent missed our answer; a sync copying a growing file)
    is recognised and only its new bytes are kept; a gap is marked in the text. Past
    ``JobLog.MAX_BYTES`` the oldest output goes. Returns False for an unknown attempt."""
    attempt = JobAttempt.objects.filter(pk=chunk.attempt_id).values_list("pk", "job_id").first()
    if attempt is None:
        return False
    offset, data = int(chunk.offset), chunk.data.encode()
    with transaction.atomic():
        row, _ = JobLog.objects.select_for_update().get_or_create(
            attempt_id=attempt[0], node=chunk.node, defaults={"job_id": attempt[1]}
        )
        if offset + len(data) <= row.end:
            return True  # already have it (a replay)
        end = offset + len(data)
        if offset > row.end:
            data = f"[… {offset - row.end} bytes not received …]\n".encode() + data
        else:
            data = data[row.end - offset :]
        text = row.text.encode() + data
        if len(text) > JobLog.MAX_BYTES:
            cut = len(text) - JobLog.MAX_BYTES
            text, row.start = text[cut:], row.start + cut
        row.text = text.decode("utf-8", "replace")
        row.end = max(row.end, end)
        row.save()
    return True
