"""Which operation a study's answers use on the synthetic math eval sets, per arm, eval row and
split: the command line of `megatron_sdpo.study.operations` (see its docstring).

    python tools/math_operations.py runs/study-smollm2 [--splits id,ood_near,ood_far] [--csv out.csv]
"""

import sys

from megatron_sdpo.study.operations import main

if __name__ == "__main__":
    sys.exit(main())
