"""The member side: the library that runs inside every trainer rank and generator worker. A
`MemberClient` registers with syncd and watches its commands, a `MemberAgent` carries them out
through an endpoint, and the data plane (`dataplane`) moves the buckets. It imports the shared
vocabulary (`syncd.commands`, `syncd.states`, `syncd.layout`, `syncd.plan`, `syncd.api`), never the
daemon (`syncd.daemon`)."""
