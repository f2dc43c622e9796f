"""Study-level code: published records, secondary analyses, the two-study scorecard."""
