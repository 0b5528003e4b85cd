"""One request's life: the phases (proxy), the relay of its stream, its deadlines, its SLO
verdict and the finish that hands the record to the sinks."""
