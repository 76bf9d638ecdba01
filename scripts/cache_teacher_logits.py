"""Write the teacher-logit cache from a checkout: the same as `distill-cache`.

    python scripts/cache_teacher_logits.py +experiment=offline_fkl

Runs the teacher once over the training (and val) data as a Lightning predict job and
stores the top-k log-probs of every trained position (docs/cache.md). Rerunning it
finishes an interrupted cache; training then reads it with the same experiment.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("distill") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed

from distill.run.cache import main  # noqa: E402

if __name__ == "__main__":
    main()
