"""Python mixed mode: watch Python processes, run py-spy on them, and join its
Python stacks with the BPF sampler's native and kernel stacks by time.

* :mod:`flamed.python.watcher` -- which processes are Python (proc connector + /proc scan)
* :mod:`flamed.python.pyspy` -- one supervised py-spy child per watched process
* :mod:`flamed.python.clock` -- the uprobe on py-spy's recorder (``bpf/pyspy_clock.bpf.c``)
* :mod:`flamed.python.align` -- calibration, placement and the join itself
* :mod:`flamed.python.mixed` -- the pieces together, per drained sampler Window
"""
