"""Analysis of eviction on agentic traces (not installed): a request-granular simulator of a
prefix-closed single-tier cache, for trying orders of chains quickly (``groupsim``)."""
