"""The swim agent: a trio daemon driving the sans-IO ``swim`` core (docs/design.md §2)."""

DISTRIBUTION = "swim-membership"
"""The distribution name on the package index (``swim`` there is another project)."""
