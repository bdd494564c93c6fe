"""Integrations with the engines users scale out on (Ray Train); each imports its engine only when used.

Import the integration's module itself (``from lightning_accel.integrations.ray import prepare_trainer``): this
package imports none of them, so that importing it needs no engine installed.
"""

__all__: list[str] = []
