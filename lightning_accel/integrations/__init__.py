"""Integrations with the engines users scale out on (Ray Train); each imports its engine only when used."""
