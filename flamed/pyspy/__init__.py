"""The py-spy path of Python frames: watch Python processes, run py-spy on
them, and join its Python stacks with the BPF sampler's native and kernel
stacks by time.

The BPF program reads the Python frames of the interpreters it can walk
itself (:mod:`flamed.sampling.pyframes`); this is the fallback for the others,
or for every process when asked.  :mod:`flamed.sampling.pysource` decides
which source a process gets.

* :mod:`flamed.pyspy.watcher` -- which processes are Python (proc connector + /proc scan)
* :mod:`flamed.pyspy.supervisor` -- one supervised py-spy child per watched process
* :mod:`flamed.pyspy.chrometrace` -- py-spy's output read: stack changes per thread
* :mod:`flamed.pyspy.clock` -- the uprobe on py-spy's recorder (``bpf/pyspy_clock.bpf.c``)
* :mod:`flamed.pyspy.clockfit` -- py-spy's clock on CLOCK_MONOTONIC, and its sample times
* :mod:`flamed.pyspy.align` -- placement of the stack changes and the join itself
* :mod:`flamed.pyspy.threadids` -- pthread ids (CPython < 3.11) to OS tids
* :mod:`flamed.pyspy.mixed` -- the pieces together, per drained sampler Window
"""
