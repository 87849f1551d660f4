"""Heartbeat ingest: validate reports into compact records and buffer them (no database)."""
