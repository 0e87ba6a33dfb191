"""``python -m mpicoll.timeline``: merge the ranks' parts of a trace (:func:`main`; a
package's ``__main__``, as ``mpicoll`` imports the timeline before ``-m`` would run it)."""
import sys

from . import main

sys.exit(main())
