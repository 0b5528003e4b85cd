"""The client side of the trust boundary: who is calling (auth), what they may send (ingress,
limits), which headers cross (headers), and what a connection may hold open (listener)."""
