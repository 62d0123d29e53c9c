"""The input pipelines: transforms of both decode paths (transforms), the data sets of a
split's file index (datasets), the DataLoader factory and its fork server (loaders), and MixUp
/ CutMix on batches (mixup). Callers import the module of their concern."""
