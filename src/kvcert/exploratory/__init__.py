"""EXPLORATORY analyses: not pre-registered, not part of the scorecard; inputs to the design of a future study."""
