"""SLO-aware admission control: predict whether a request can meet its TTFT and TPOT targets,
then admit it to the best replica, queue it (earliest deadline first within priority bands), or
reject it early with 429 + Retry-After — so that goodput stays high under overload."""
