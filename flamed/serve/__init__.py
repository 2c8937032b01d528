"""``flamed serve``: a read-only local web viewer over profile files.

:mod:`flamed.serve.index` indexes the inputs (sidecars, not stacks) and answers
timeline and range queries; :mod:`flamed.serve.server` puts them behind a
stdlib HTTP server with the page in ``assets/``.
"""
