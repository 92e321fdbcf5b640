"""One rank's capture and restore: an engine running stage tables over a frozen context and a per-epoch
state (docs/architecture.md, "One rank"). Root side: only the agent imports it."""
