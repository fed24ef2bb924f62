"""Print the NeMo Gym working directory that holds ``resources_servers/sandpool_swe``."""

from sandpool.integrations.nemo_gym import ROOT

print(ROOT)
