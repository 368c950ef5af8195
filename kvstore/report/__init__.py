"""kvreport: hit-rate analytics from the event log (``kvreport --help``; docs/operations.md)."""
