from attnzoo import ZooSoftmaxConfig
from tests.family_suite import FamilySuite


class TestSoftmaxFamily(FamilySuite):
    config_class = ZooSoftmaxConfig
    prefix = "ZooSoftmax"
