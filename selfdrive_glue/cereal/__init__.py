"""Our cereal schema files (*.capnp); a package only so that packaging ships them (pyproject package-data "*.capnp")."""
