"""Study-level code: published records, secondary analyses, the combined scorecard."""
