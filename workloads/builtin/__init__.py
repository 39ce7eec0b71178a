"""Built-in workload specs (YAML), listed by `bench workload list`."""
