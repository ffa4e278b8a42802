"""What both sides must agree on: the spec, the wire, layouts, routes, partitions, the rebuild."""
