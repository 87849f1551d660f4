"""Job output, as clusters ship it: stored per attempt and node, in bytes, capped."""

from __future__ import annotations

from django.db import transaction

from clusters.adapters.base import LogChunk
from scheduling.models import JobAttempt, JobLog


def store_log(chunk: LogChunk, *, max_gap: int | None = None) -> bool:
    """Append a chunk of output. ``offset`` is where the chunk starts in the node's stream, in
    bytes, so a chunk sent again (the agent missed our answer; a sync copying a growing file)
    is recognised and only its new bytes are kept; a gap is marked in the text. Past
    ``JobLog.MAX_BYTES`` the oldest output goes. Any text is stored: a NUL byte (which
    PostgreSQL's text cannot hold) becomes U+FFFD, and so does what is not UTF-8. Returns False
    for an unknown attempt, and for a chunk starting more than ``max_gap`` bytes past what is
    stored (nothing is written then)."""
    attempt = JobAttempt.objects.filter(pk=chunk.attempt_id).values_list("pk", "job_id").first()
    if attempt is None:
        return False
    offset, data = int(chunk.offset), chunk.data.encode("utf-8", "replace")
    with transaction.atomic():
        row, _ = JobLog.objects.select_for_update().get_or_create(
            attempt_id=attempt[0], node=chunk.node, defaults={"job_id": attempt[1]}
        )
        if offset + len(data) <= row.end:
            return True  # already have it (a replay)
        if max_gap is not None and offset - row.end > max_gap:
            return False
        end = offset + len(data)
        if offset > row.end:
            data = f"[… {offset - row.end} bytes not received …]\n".encode() + data
        else:
            data = data[row.end - offset :]
        text = row.text.encode() + data.replace(b"\x00", "\ufffd".encode())
        if len(text) > JobLog.MAX_BYTES:
            cut = len(text) - JobLog.MAX_BYTES
            # past a gap the text is shorter than the stream it stands for: the first byte kept
            # is where the kept text starts counting back from the end
            text, row.start = text[cut:], max(row.start + cut, end - JobLog.MAX_BYTES)
        row.text = text.decode("utf-8", "replace")
        row.end = max(row.end, end)
        row.save()
    return True
