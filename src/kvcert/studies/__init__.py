"""Study-2 analysis code outside the study-1-locked kvcert.analysis (which it imports, never edits)."""
