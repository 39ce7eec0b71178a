"""Built-in fault plans (YAML), listed by `bench faults list`."""
