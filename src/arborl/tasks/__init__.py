"""Built-in task suites."""
