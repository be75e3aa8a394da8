"""Train a P-EAGLE draft head: `eagle-train` with method peagle (`python scripts/train_peagle.py --help`).

accelerate launch scripts/train_peagle.py --config peagle_smollm2 [key=value ...]
"""

import functools

from eagle_cli.train import main

main = functools.partial(main, method="peagle")

if __name__ == "__main__":
    main()
