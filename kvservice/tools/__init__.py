"""Tools: the launcher (services as separate processes, ``kvservice up``) and the benchmark."""
