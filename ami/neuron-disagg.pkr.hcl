# The neuron-disagg AMIs: one for Trainium, from the Neuron DLAMI of the pinned Neuron SDK release
# (neuron_sdk_version, found by the SDK version in the DLAMI's description, so that a rebuild never
# picks up another SDK unnoticed), and one for H200 / p5en, from the latest GPU DLAMI (its public SSM
# parameter). Either can be pinned to an AMI id instead (neuron_source_ami / cuda_source_ami).
# Provisioning installs and verifies, in order: the EFA software (the pinned installer,
# GPG-checked, unless the DLAMI's is as new), RDMA memory limits, vLLM + NIXL + neuron-disagg,
# what NIXL's LIBFABRIC plugin needs besides libfabric (Trainium: libcuda stub, CUDA runtime,
# hwloc; H200: CUDA runtime, hwloc), the systemd units (and the model cache on local NVMe); the
# last step runs `neuron-disagg doctor --image --platform <neuron|cuda>` and fails the build if it
# fails. The builders are ordinary m6i instances (see neuron_instance_type for why), reached through
# Session Manager by default, so that they build in a private subnet (see builder_connect). Each AMI
# is tagged with what it was built from: the source AMI's id and name, the Neuron SDK, the EFA
# installer pin, NIXL.
#
#   ami/build.sh                       # checks the DLAMI and the network, builds the wheel, then
#                                      # `packer init` + `packer build` here
#   packer build -only='amazon-ebs.neuron' -var wheel=dist/neuron_disagg-0.1.0-py3-none-any.whl ami/
#
# `neuron-disagg launch` finds the result by its tag neuron-disagg:platform = neuron | cuda.

packer {
  required_plugins {
    amazon = {
      version = ">= 1.3.0"
      source  = "github.com/hashicorp/amazon"
    }
  }
}

variable "region" {
  type        = string
  default     = "us-east-2"
  description = "Region to build in; the AMI is usable there (copy it for others)."
}

variable "wheel" {
  type        = string
  description = "Path to the neuron_disagg wheel to install (ami/build.sh builds it into dist/)."
}

variable "package_version" {
  type        = string
  default     = "0.1.0"
  description = "Recorded in the AMI's tags."
}

# The Neuron DLAMI, pinned by SDK release: AWS's SSM parameters name only the latest DLAMI of each
# kind and OS (.../ubuntu-24.04/latest), which stops moving when a release moves to another OS, and
# each Neuron DLAMI names its SDK release in its description (the Neuron DLAMI guide: find a DLAMI for
# a specific SDK version by describe-images with a description filter). ami/build.sh checks, before
# anything runs, that this finds a DLAMI (neuron_disagg/deploy/bake.py). The image must ship a vLLM
# environment (30-python.sh checks). Another release: -var neuron_sdk_version=2.33.0, and
# -var 'neuron_dlami_name=Deep Learning AMI Neuron (Ubuntu 26.04) *' where that release's DLAMI runs
# another OS.
variable "neuron_sdk_version" {
  type        = string
  default     = "2.32.0"
  description = "Neuron SDK release whose DLAMI the Trainium AMI starts from (tag neuron-disagg:neuron-sdk)."
}

variable "neuron_dlami_name" {
  type        = string
  default     = "Deep Learning AMI Neuron (Ubuntu 24.04) *"
  description = "Name pattern of the Neuron DLAMI (the multi-framework one, which ships vLLM)."
}

variable "cuda_ssm_parameter" {
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
  description = "Public SSM parameter holding the GPU DLAMI to start from."
}

# Pinning one AMI: an AMI id (per region) rebuilds from exactly that image; a Neuron one must still be
# a DLAMI of neuron_sdk_version (Packer adds it to the filter). The AMI records its source in the tags
# neuron-disagg:source-ami and :source-ami-name.
variable "neuron_source_ami" {
  type        = string
  default     = null
  description = "Neuron DLAMI id to start from (null: the newest DLAMI of neuron_sdk_version)."
}

variable "cuda_source_ami" {
  type        = string
  default     = null
  description = "GPU DLAMI id to start from instead of the SSM parameter's latest (null: latest)."
}

# The builders are small general-purpose instances, not trn2/p5en: nothing in the bake needs an
# accelerator. The EFA installer, the Neuron and NVIDIA driver packages (already in the DLAMIs) and
# vLLM's wheels install without the devices, and the last step, `neuron-disagg doctor --image`,
# checks that the software loads without requiring devices (tests/deploy/test_ami.py runs it on a
# host with none). So a bake needs no Capacity Block and no accelerator quota, starts in any zone
# and costs well under a dollar an hour instead of tens of dollars. m6i: x86_64 Nitro (both DLAMIs
# are x86_64 images with ENA, which boot on it), offered in every commercial region; 8 vCPUs and
# 32 GiB build the EFA kernel module and install vLLM/torch wheels quickly. What only the serving
# hardware can show (devices, EFA) `neuron-disagg doctor` checks on the launched instances.
variable "neuron_instance_type" {
  type        = string
  default     = "m6i.2xlarge"
  description = "Builder for the Trainium AMI: any x86_64 Nitro type (no Trainium needed; see above)."
}

variable "cuda_instance_type" {
  type        = string
  default     = "m6i.2xlarge"
  description = "Builder for the H200 AMI: any x86_64 Nitro type (no GPU needed; see above)."
}

variable "subnet_id" {
  type        = string
  default     = null
  description = "Subnet for the builder (one whose zone has capacity for the builder type); default VPC if null."
}

# How Packer reaches the builder. session_manager (the default): an SSH session tunnelled through AWS
# Systems Manager, so the builder needs no public address and no inbound rule: it works in a private
# subnet with a NAT gateway (the one examples/README.md, step 2, uses for the instances) and in the
# default VPC. It needs the Session Manager plugin where Packer runs, and IAM permission to create
# the builder's temporary instance profile (Packer makes and deletes it; its policy is below).
# public_ip: the builder gets a public IP and Packer connects to it directly; the subnet must route
# 0.0.0.0/0 to an internet gateway. Either way the builder downloads packages: the subnet must reach
# the internet. ami/build.sh checks both before anything runs.
variable "builder_connect" {
  type        = string
  default     = "session_manager"
  description = "session_manager (private subnets; needs the Session Manager plugin) or public_ip (a public subnet)."
  validation {
    condition     = contains(["session_manager", "public_ip"], var.builder_connect)
    error_message = "The builder_connect value must be session_manager or public_ip."
  }
}

# Regions the AMI is copied to when it is made; Packer copies its tags along, which launch finds it by
# (a copy made later by hand keeps them only with `aws ec2 copy-image --copy-image-tags`).
variable "ami_regions" {
  type        = list(string)
  default     = []
  description = "Further regions to copy the AMIs to, tags included."
}

variable "capacity_reservation_id" {
  type        = string
  default     = null
  description = "Optional capacity reservation (cr-...) for the builder; the default builders need none."
}

variable "nixl_version" {
  type        = string
  default     = "1.5.0"
  description = "NIXL installed by 30-python.sh (exactly this version); tag neuron-disagg:nixl. 1.5.1 needs libfabric 2.7.0 (EFA installer 1.51.0)."
}

variable "efa_installer_version" {
  type        = string
  default     = "1.50.0"
  description = "EFA installer 10-efa.sh downloads (GPG-checked) unless the DLAMI's is this version or newer; tag neuron-disagg:efa-installer-min. The exact version is in /etc/neuron-disagg/image-versions on the AMI."
}

variable "doctor_command" {
  type        = string
  default     = ""
  description = "The last provisioning step; the build fails if it exits non-zero. Empty: `neuron-disagg doctor --image --platform <neuron|cuda>` (scripts/90-doctor.sh)."
}

variable "root_volume_gib" {
  type    = number
  default = 200
}

data "amazon-parameterstore" "cuda_dlami" {
  name   = var.cuda_ssm_parameter
  region = var.region
}

locals {
  stamp = formatdate("YYYYMMDD-hhmmss", timestamp())
  stage = "/tmp/neuron-disagg-ami"
  # The SSM parameter is always read (it must exist); a pinned id wins.
  cuda_source_ami = coalesce(var.cuda_source_ami, data.amazon-parameterstore.cuda_dlami.value)
  # What the builders may do: answer Session Manager (session_manager), nothing else.
  ssm_session_actions = [
    "ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel",
  ]
  tags = {
    "neuron-disagg:version"           = var.package_version
    "neuron-disagg:built"             = local.stamp
    "neuron-disagg:nixl"              = var.nixl_version
    "neuron-disagg:efa-installer-min" = var.efa_installer_version
    # The DLAMI's name carries its release date ("... (Ubuntu 24.04) 20261006"): Packer's build data.
    "neuron-disagg:source-ami-name" = "{{ .SourceAMIName }}"
  }
}

source "amazon-ebs" "neuron" {
  region = var.region
  # The newest DLAMI of the pinned Neuron SDK release; a pinned id must match the filter too.
  source_ami = var.neuron_source_ami
  source_ami_filter {
    filters = {
      name        = var.neuron_dlami_name
      description = "*Neuron SDK ${var.neuron_sdk_version}*"
      state       = "available"
    }
    owners      = ["amazon"]
    most_recent = true
  }
  instance_type                             = var.neuron_instance_type
  subnet_id                                 = var.subnet_id
  capacity_reservation_id                   = var.capacity_reservation_id
  ssh_username                              = "ubuntu"
  ssh_interface                             = var.builder_connect
  associate_public_ip_address               = var.builder_connect == "public_ip" ? true : null
  # Packer's temporary security group lets SSH in from this machine's public address only, not 0.0.0.0/0.
  temporary_security_group_source_public_ip = true
  dynamic "temporary_iam_instance_profile_policy_document" {
    for_each = var.builder_connect == "session_manager" ? [1] : []
    content {
      Version = "2012-10-17"
      Statement {
        Effect   = "Allow"
        Action   = local.ssm_session_actions
        Resource = ["*"]
      }
    }
  }
  ami_name        = "neuron-disagg-neuron-${var.package_version}-${local.stamp}"
  ami_description = "neuron-disagg ${var.package_version} on the Neuron DLAMI (Neuron SDK ${var.neuron_sdk_version}): EFA, NIXL ${var.nixl_version}, vLLM (vllm-neuron), units"
  ami_regions     = var.ami_regions
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.root_volume_gib
    volume_type           = "gp3"
    delete_on_termination = true
  }
  tags = merge(local.tags, {
    "Name"                     = "neuron-disagg-neuron-${local.stamp}"
    "neuron-disagg:platform"   = "neuron"
    "neuron-disagg:neuron-sdk" = var.neuron_sdk_version
    # The id Packer resolved (the filter's newest, or the pinned one): its build data.
    "neuron-disagg:source-ami" = "{{ .SourceAMI }}"
  })
}

source "amazon-ebs" "cuda" {
  region                                    = var.region
  source_ami                                = local.cuda_source_ami
  instance_type                             = var.cuda_instance_type
  subnet_id                                 = var.subnet_id
  capacity_reservation_id                   = var.capacity_reservation_id
  ssh_username                              = "ubuntu"
  ssh_interface                             = var.builder_connect
  associate_public_ip_address               = var.builder_connect == "public_ip" ? true : null
  temporary_security_group_source_public_ip = true
  dynamic "temporary_iam_instance_profile_policy_document" {
    for_each = var.builder_connect == "session_manager" ? [1] : []
    content {
      Version = "2012-10-17"
      Statement {
        Effect   = "Allow"
        Action   = local.ssm_session_actions
        Resource = ["*"]
      }
    }
  }
  ami_name        = "neuron-disagg-cuda-${var.package_version}-${local.stamp}"
  ami_description = "neuron-disagg ${var.package_version} on the GPU DLAMI: EFA, NIXL ${var.nixl_version}, vLLM, units"
  ami_regions     = var.ami_regions
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.root_volume_gib
    volume_type           = "gp3"
    delete_on_termination = true
  }
  tags = merge(local.tags, {
    "Name"                     = "neuron-disagg-cuda-${local.stamp}"
    "neuron-disagg:platform"   = "cuda"
    "neuron-disagg:source-ami" = local.cuda_source_ami
  })
}

build {
  sources = ["source.amazon-ebs.neuron", "source.amazon-ebs.cuda"]

  # Everything the scripts need, staged on the builder: the units, the boot-time script and the
  # wheel (which carries the libcuda stub's source; 40-fabric-libs.sh builds it on Trainium with the
  # package's own command).
  provisioner "shell" {
    inline = ["mkdir -p ${local.stage}/units ${local.stage}/boot"]
  }
  provisioner "file" {
    sources     = [var.wheel]
    destination = "${local.stage}/"
  }
  provisioner "file" {
    source      = "${path.root}/units/"
    destination = "${local.stage}/units"
  }
  provisioner "file" {
    source      = "${path.root}/boot/"
    destination = "${local.stage}/boot"
  }

  provisioner "shell" {
    execute_command = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = [
      "PLATFORM=${source.name}", "STAGE=${local.stage}", "NIXL_VERSION=${var.nixl_version}",
      "EFA_VERSION=${var.efa_installer_version}",
    ]
    scripts = [
      "${path.root}/scripts/10-efa.sh",
      "${path.root}/scripts/20-rdma-limits.sh",
      "${path.root}/scripts/30-python.sh",
    ]
  }

  # Both images: on Trainium a libcuda stub, the CUDA runtime and hwloc; on H200 the CUDA runtime
  # and hwloc (the NVIDIA driver has libcuda). The script passes --platform from PLATFORM.
  provisioner "shell" {
    execute_command  = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = ["PLATFORM=${source.name}", "STAGE=${local.stage}"]
    script           = "${path.root}/scripts/40-fabric-libs.sh"
  }

  provisioner "shell" {
    execute_command  = "chmod +x {{ .Path }}; sudo -E bash '{{ .Path }}'"
    environment_vars = ["PLATFORM=${source.name}", "STAGE=${local.stage}", "DOCTOR_COMMAND=${var.doctor_command}"]
    scripts = [
      "${path.root}/scripts/50-units.sh",
      "${path.root}/scripts/90-doctor.sh",
    ]
  }

  provisioner "shell" {
    inline = ["sudo rm -rf ${local.stage}"]
  }
}
