@0xf0dba17f5dc25a86;
