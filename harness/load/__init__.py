"""The load generator, sessions, worker processes and Ray actors, and the recorder they feed."""
