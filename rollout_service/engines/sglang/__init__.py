"""The SGLang engine (`engine`) over an SGLang server's HTTP API (`client`), its weight
updates (`weights`) and the launch of a managed server (`server`)."""
