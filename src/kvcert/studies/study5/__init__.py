"""Study 5 (preregistration/study5/PLAN.md): draws that disagree. Several draws of the studies' randomized policy
from one read of the prompt, the agreement of their answers as a per-answer escalation signal, against confidence,
the certificate, the task x length cell rule, random and the oracle.

    python -m kvcert.studies.study5 pilot|select|run|analyze ...
"""
